"""The measuring loop the DataLoader-based data peers share: time to the first batch, then
tokens/s over `steps` batches after `warmup`, printed as one JSON line."""
import json
import time


def forever(loader):
    """Batches across epochs: a new epoch starts when one runs out."""
    while True:
        yield from loader


def measure(loader, t0, args, peer, **extra):
    it = forever(loader)
    first = next(it)
    first_batch_s = time.perf_counter() - t0
    assert first.shape == (args.batch, args.seq + 1)
    for _ in range(args.warmup):
        next(it)
    checksum = 0
    start = time.perf_counter()
    for _ in range(args.steps):
        batch = next(it)
        checksum ^= int(batch[0, 0])
    seconds = time.perf_counter() - start
    print(json.dumps({
        "peer": peer,
        "tokens_per_s": args.steps * args.batch * args.seq / seconds,
        "first_batch_s": first_batch_s,
        "checksum": checksum,
        **extra,
    }))
