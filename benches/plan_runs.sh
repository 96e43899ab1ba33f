# Sourced by plan_calibration.sh and plan_tensor.sh: the release build and the priority their runs
# take (PRIORITY, STOKE), the rounds of their runs and the reports they give `stoke plan
# --calibrate`. Before `train_rounds` and `reports` the caller sets ROUNDS, the arrays CALIBRATION
# and HELD_OUT (each entry "name ..."), and defines `train_spec ROUND SPEC`, which trains one entry
# as runs/<name>-ROUND.

if chrt -f 10 true 2>/dev/null; then
    PRIORITY=(chrt -f 10)
elif nice -n -10 true 2>/dev/null; then
    PRIORITY=(nice -n -10)
else
    PRIORITY=()
fi
STOKE=target/release/stoke
cargo build --release --quiet --bin stoke || {
    [ -x "$STOKE" ] || exit 1
    echo "warning: build failed; using the existing $STOKE" >&2
}

# The report of every round of every entry named.
reports() {
    for spec in "$@"; do
        for round in $(seq 1 "$ROUNDS"); do
            echo "runs/${spec%% *}-$round/report.json"
        done
    done
}

# Each round trains every entry once, calibration and held-out entries alternating, so that a slow
# spell of the machine falls on both sets rather than on one.
train_rounds() {
    local order=() idx round spec
    for idx in "${!CALIBRATION[@]}"; do
        order+=("${CALIBRATION[$idx]}")
        if [ "$idx" -lt "${#HELD_OUT[@]}" ]; then
            order+=("${HELD_OUT[$idx]}")
        fi
    done
    for round in $(seq 1 "$ROUNDS"); do
        for spec in "${order[@]}"; do
            train_spec "$round" "$spec"
        done
    done
}
