"""stoke.trace gives what the stoke-trace binary prints for the same traces."""

import json
import subprocess

import pytest

import stoke

FIXTURES = [
    "hta_trace_filter_sampled_rank-0.json.gz",
    "hta_critical_path_simple_add_benchmark_result_493459_1694039959_trace.json.gz",
    "hta_amd_trace_mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    "hta_nccl_parser_config_nccl_data.json.gz",
]


def binary_json(stoke_trace, *args):
    out = subprocess.run([stoke_trace, *args, "--format", "json"], capture_output=True, text=True)
    assert out.returncode in (0, 3), out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", FIXTURES)
def test_analyze_equals_the_binary_json(stoke_trace, traces, name):
    assert stoke.trace.analyze(traces / name) == binary_json(stoke_trace, "analyze", str(traces / name))


def test_two_ranks_and_options_equal_the_binary_json(stoke_trace, traces):
    ranks = [traces / "hta_trace_filter_sampled_rank-0.json.gz", traces / "hta_trace_filter_sampled_rank-1.json.gz"]
    ours = stoke.trace.analyze(ranks, top=3, model_flops=1e12, peak_flops=1e14)
    args = ["analyze", *map(str, ranks), "--top", "3", "--model-flops", "1e12", "--peak-flops", "1e14"]
    assert ours == binary_json(stoke_trace, *args)
    assert len(ours["ranks"]) == 2


def test_diff_equals_the_binary_json(stoke_trace, traces):
    base, new = traces / "hta_trace_filter_sampled_rank-0.json.gz", traces / "hta_trace_filter_sampled_rank-1.json.gz"
    assert stoke.trace.diff(base, new) == binary_json(stoke_trace, "diff", str(base), str(new))


def test_text_reports_equal_the_binary(stoke_trace, traces):
    path = str(traces / FIXTURES[0])
    for fmt in ("table", "markdown", "prometheus"):
        out = subprocess.run([stoke_trace, "analyze", path, "--format", fmt], capture_output=True, text=True, check=True)
        assert stoke.trace.report(path, format=fmt) == out.stdout


def test_frames_hold_the_steps(traces):
    pytest.importorskip("pandas")
    analysis = stoke.trace.analyze(traces / FIXTURES[0])
    frames = stoke.trace.frames(analysis)
    assert len(frames["steps"]) == len(analysis["ranks"][0]["steps"])
    assert "wall_ns" in frames["steps"].columns


def test_an_unreadable_trace_is_a_trace_error_naming_it(tmp_path):
    bad = tmp_path / "rank-0.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "ts": ')
    with pytest.raises(stoke.TraceError, match="rank-0.json"):
        stoke.trace.analyze(bad)
