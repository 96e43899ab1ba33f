"""PyTorch peers of a stoke checkpoint save: `torch.save` (then fsync, as stoke syncs) and
PyTorch Distributed Checkpoint's `async_save` (FileSystemWriter, which fsyncs its files) of the
same state: the tensors of a stoke checkpoint folder, read from its safetensors files with no
library but torch. Prints one JSON line: per repeat, torch.save's time, async_save's stall (until
it returns; the training step's cost) and its total (until the save is done), and the bytes.

    python ckpt_torch.py --state runs/bench-ckpt/sync-0/checkpoints/step-12 --out runs/bench-ckpt/peer --repeats 3
"""
import argparse
import json
import os
import shutil
import struct
import time

import torch

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        t = torch.frombuffer(bytearray(body[begin:end]), dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]) if info["shape"] else t.reshape(())
    return out


def load_state(folder):
    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            stem = name[: -len(".safetensors")]
            for key, t in read_safetensors(os.path.join(folder, name)).items():
                state[f"{stem}.{key}"] = t
    return state


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", required=True, help="a stoke checkpoint folder (step-<n>)")
    ap.add_argument("--out", required=True, help="scratch folder for the peers' files")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    state = load_state(args.state)
    n_bytes = sum(t.numel() * t.element_size() for t in state.values())
    os.makedirs(args.out, exist_ok=True)

    # One process, no process group: DCP then saves without collectives.
    import torch.distributed.checkpoint as dcp

    results = {"torch_save_s": [], "dcp_async_stall_s": [], "dcp_async_total_s": []}
    for r in range(args.repeats):
        # torch.save, made durable like a stoke save.
        path = os.path.join(args.out, f"torch-save-{r}.pt")
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        results["torch_save_s"].append(time.perf_counter() - start)
        os.remove(path)

        # DCP async_save: returns once the state is staged in host memory, writes in the background.
        folder = os.path.join(args.out, f"dcp-{r}")
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
        stall = time.perf_counter() - start
        future.result()
        fsync_tree(folder)
        results["dcp_async_stall_s"].append(stall)
        results["dcp_async_total_s"].append(time.perf_counter() - start)
        shutil.rmtree(folder, ignore_errors=True)
    results["bytes"] = n_bytes
    results["torch"] = torch.__version__
    print(json.dumps(results))


if __name__ == "__main__":
    main()
