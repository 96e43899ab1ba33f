"""HTA (HolisticTraceAnalysis) on the same trace files as `stoke trace analyze`, printing its
numbers as JSON so that benches/trace_vs_hta.sh and benches/TRACE_VS_HTA.md can compare them.

usage: hta_analyze.py [--together] [--quick] FILE...

Each file is analysed as rank 0 of its own TraceAnalysis (HTA's idle-time breakdown fails with
default arguments on other ranks); with --together all files form one multi-rank analysis keyed
by file order. --quick runs only the load and the temporal breakdown (for the big benchmark).
Times are HTA's: microseconds.
"""

import json
import logging
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from hta.trace_analysis import TraceAnalysis  # noqa: E402


def records(df):
    return json.loads(df.to_json(orient="records"))


def attempt(out, key, fn):
    try:
        out[key] = fn()
    except Exception as exc:  # HTA raises on some traces; record it and go on.
        out[key] = {"error": f"{type(exc).__name__}: {exc}"}


def analyse(trace_files, quick):
    out = {}
    t0 = time.perf_counter()
    ta = TraceAnalysis(trace_files=trace_files)
    out["load_s"] = time.perf_counter() - t0
    ranks = sorted(trace_files)
    t1 = time.perf_counter()
    attempt(out, "temporal", lambda: records(ta.get_temporal_breakdown(visualize=False)))
    if not quick:
        def idle():
            result = {}
            for rank in ranks:
                df, _ = ta.get_idle_time_breakdown(ranks=[rank], visualize=False)
                result[rank] = records(df)
            return result

        attempt(out, "idle", idle)

        def kernels():
            by_type, by_kernel = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=10)
            return {"by_type": records(by_type), "top": records(by_kernel.head(10))}

        attempt(out, "kernels", kernels)
        attempt(out, "overlap", lambda: records(ta.get_comm_comp_overlap(visualize=False)))

        def launches():
            stats = ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False)
            return {
                rank: {
                    "count": int(len(df)),
                    "launch_delay_mean": float(df["launch_delay"].mean()) if len(df) else None,
                    "cpu_duration_mean": float(df["cpu_duration"].mean()) if len(df) else None,
                    "runtime_outliers": int((df["cpu_duration"] > 50).sum()),
                    "launch_delay_outliers": int((df["launch_delay"] > 100).sum()),
                }
                for rank, df in stats.items()
            }

        attempt(out, "launches", launches)
        attempt(out, "queue", lambda: records(ta.get_queue_length_summary(ranks=ranks).reset_index()))
        attempt(out, "memory_bw", lambda: records(ta.get_memory_bw_summary(ranks=ranks).reset_index()))
    out["analyses_s"] = time.perf_counter() - t1
    return out


def main(argv):
    together = "--together" in argv
    quick = "--quick" in argv
    # HTA resolves relative paths against its default trace directory: pass absolute ones.
    files = [os.path.abspath(a) for a in argv if not a.startswith("--")]
    if together:
        result = analyse({rank: path for rank, path in enumerate(files)}, quick)
    else:
        result = {path: analyse({0: path}, quick) for path in files}
    json.dump(result, sys.stdout, indent=1, default=str)
    print()


if __name__ == "__main__":
    main(sys.argv[1:])
