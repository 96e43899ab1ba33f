//! The common time line of a data-parallel run's traces: every rank starts its first step
//! together and rank 0 measures each other rank's clock against its own.

use anyhow::Context;
use stoke_comm::CommunicatorExt;
use stoke_train::DataParallel;

/// Ping-pongs per rank in `start_together`: the one with the shortest round trip gives the offset.
const CLOCK_ROUNDS: usize = 16;

/// The common time line of a data-parallel run's traces. Every rank leaves a barrier just before its
/// first step and takes that instant as the zero of its own monotonic clock. The barrier releases
/// the ranks up to a scheduler wake-up apart (milliseconds on a busy machine), so rank 0 then
/// measures each rank's zero against its own: `CLOCK_ROUNDS` ping-pongs, each giving the rank's
/// reading minus the midpoint of rank 0's send and receive; the round with the shortest round trip
/// is kept (off by at most half of it). Returns the zero, the host's CLOCK_MONOTONIC then (ns; a
/// check of the offsets when the ranks share a host) and, on rank 0, the offsets.
pub fn start_together(
    dist: &DataParallel,
) -> anyhow::Result<(std::time::Instant, Option<u64>, Vec<stoke_prof::ClockOffset>)> {
    let (rank, comm) = (dist.rank(), dist.communicator());
    comm.barrier().with_context(|| format!("rank {rank}: barrier before the first step"))?;
    let (zero, host_ns) = zero_with_host_clock();
    let now_us = || zero.elapsed().as_secs_f64() * 1e6;
    let context = |peer: usize| format!("rank {rank}: clock alignment with rank {peer}");
    let mut offsets = Vec::new();
    if rank == 0 {
        for peer in 1..dist.world_size() {
            let mut best = stoke_prof::ClockOffset {
                rank: peer,
                offset_us: 0.0,
                round_trip_us: f64::INFINITY,
                host_clock_offset_us: None,
            };
            for _ in 0..CLOCK_ROUNDS {
                let sent = now_us();
                comm.send(&sent.to_le_bytes(), peer).with_context(|| context(peer))?;
                let mut reply = [0u8; 8];
                comm.recv(&mut reply, peer).with_context(|| context(peer))?;
                let back = now_us();
                if back - sent < best.round_trip_us {
                    let theirs = f64::from_le_bytes(reply);
                    best.offset_us = theirs - (sent + back) / 2.0;
                    best.round_trip_us = back - sent;
                }
            }
            offsets.push(best);
        }
    } else {
        for _ in 0..CLOCK_ROUNDS {
            let mut ping = [0u8; 8];
            comm.recv(&mut ping, 0).with_context(|| context(0))?;
            comm.send(&now_us().to_le_bytes(), 0).with_context(|| context(0))?;
        }
    }
    Ok((zero, host_ns, offsets))
}

/// Now, and the host's CLOCK_MONOTONIC now (ns): the midpoint of readings just before and after,
/// retried when the process was descheduled in between (more than 10 us apart), so the two name
/// the same moment within 5 us.
fn zero_with_host_clock() -> (std::time::Instant, Option<u64>) {
    let mut zero = std::time::Instant::now();
    for _ in 0..10 {
        let (Some(before), now, Some(after)) = (host_monotonic_ns(), std::time::Instant::now(), host_monotonic_ns())
        else {
            return (zero, None);
        };
        zero = now;
        if after - before <= 10_000 {
            return (zero, Some(before + (after - before) / 2));
        }
    }
    (zero, None)
}

/// The host's CLOCK_MONOTONIC, ns (None if the call fails).
fn host_monotonic_ns() -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}
