#!/usr/bin/env bash
# Compressed gradient averaging: bytes on the wire and time of one
# all-reduce (average) of a gradient-sized fp32 buffer (default 6,553,600 values = 25 MiB, DDP's bucket)
# on 2 processes over the shm backend: the communicator's fp32 all-reduce against the compressor's int8
# (block 256 and 64, error feedback), bf16 and fp32 payloads, with a one-thread memcpy of the buffer
# measured in the same run as the physical limit, and the codec's own GB/s (encode with error feedback,
# decode-and-add) against that memcpy. Variants interleave within each round; each figure is
# the median of the rounds' medians with min and max.
#
#   benches/compress.sh [rounds] [values]      # defaults: 5 rounds, 6553600 values
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
values=${2:-6553600}
cargo build --release --quiet -p stoke-train --example compress_bench
exec target/release/examples/compress_bench --rounds "$rounds" --values "$values" --iters 9
