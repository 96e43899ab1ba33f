"""PyTorch gloo all-reduce peer for stoke-comm-bench: the same loop as `stoke-comm-worker bench`.

Started once per rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Rank 0 prints one JSON line per size: {"bytes": B, "median_s": T, "min_s": T}.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist


def iterations(nbytes: int) -> int:
    # Same rule as the Rust worker: about 256 MiB moved per size, 5..200 iterations.
    return max(5, min(200, (256 << 20) // max(nbytes, 1)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for nbytes in (int(s) for s in args.sizes.split(",")):
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(buf)
        times = []
        for _ in range(iterations(nbytes)):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - start)
        times.sort()
        if rank == 0:
            print(json.dumps({"bytes": nbytes, "median_s": times[len(times) // 2], "min_s": times[0]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
