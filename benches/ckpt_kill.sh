#!/usr/bin/env bash
# SIGKILL the trainer at random moments while it writes checkpoints (one after every step) and
# deletes old ones (keep 2), TRIALS times (default 50). After every kill: the checkpoints left
# verify (`stoke ckpt verify`), `stoke train --resume` continues from the latest without
# --fallback, and the finished run's losses equal an uninterrupted run's bit for bit, each step
# once. Prints how many kills landed mid-write (a temporary folder was left) and mid-deletion
# (trash was left). The driver is the integration test tests/it/ckpt_crash.rs.
#
#   benches/ckpt_kill.sh [TRIALS]
set -euo pipefail
cd "$(dirname "$0")/.."
STOKE_CKPT_KILL_TRIALS="${1:-50}" cargo test --quiet -p stoke --test it -- --exact \
    ckpt_crash::sigkill_during_checkpoint_writes_and_retention_never_breaks_resume --nocapture
