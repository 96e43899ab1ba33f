//! Finding the other ranks: every rank publishes, in the TCP store, the address of its listener
//! (`tcp/{rank}`) and the node it runs on (`tcp/{rank}/node`), then reads everyone else's.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

use crate::config::DistEnv;
use crate::error::{CommError, Result};
use crate::store::StoreClient;

/// How much longer than the others rank 0, the store's host, waits for a missing rank.
const STORE_HOST_GRACE: Duration = Duration::from_secs(1);

/// Where every world rank listens and which node it is on.
pub(super) struct Directory {
    pub addrs: Vec<SocketAddr>,
    pub nodes: Vec<String>,
}

/// The name of this process's node: `node N` from the launcher's node rank, else the hostname
/// and the kernel's boot id (two containers of one machine share a boot id and shared memory).
pub(super) fn node_identity(env: &DistEnv) -> String {
    match env.node_rank {
        Some(node) => format!("node {node}"),
        None => format!("host {} (boot {})", hostname(), crate::shm::boot_id()),
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; gethostname NUL-terminates within it when the
    // name fits, and we stop at the first NUL or the end.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return String::from("unknown");
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The local address whose route reaches `host:port` (the master): a UDP socket connected there
/// picks it without sending anything.
pub(super) fn local_ip_towards(host: &str, port: u16, rank: usize) -> Result<IpAddr> {
    let place = format!("{host}:{port}");
    let failed = |reason: String| CommError::Rendezvous { rank, place: place.clone(), reason };
    let target = (host, port)
        .to_socket_addrs()
        .map_err(|e| failed(format!("MASTER_ADDR does not resolve: {e}")))?
        .next()
        .ok_or_else(|| failed("MASTER_ADDR resolves to no address".into()))?;
    let any: SocketAddr = if target.is_ipv4() { "0.0.0.0:0".parse() } else { "[::]:0".parse() }.expect("literal");
    let probe = UdpSocket::bind(any).map_err(|e| failed(format!("cannot open a UDP socket to find the route: {e}")))?;
    probe.connect(target).map_err(|e| failed(format!("no route to the master: {e}")))?;
    let local = probe.local_addr().map_err(|e| failed(format!("cannot read the routed local address: {e}")))?;
    Ok(local.ip())
}

/// Publishes this rank's listener and node, then reads every other rank's until `deadline`.
pub(super) fn exchange(
    store: &mut StoreClient,
    env: &DistEnv,
    listen: SocketAddr,
    node: &str,
    timeout: Duration,
    deadline: Instant,
) -> Result<Directory> {
    let rank = env.rank;
    let place = store.place.clone();
    let failed = |reason: String| CommError::Rendezvous { rank, place: place.clone(), reason };
    // The node first: a rank that reads the address can read the node.
    store.set(&format!("tcp/{rank}/node"), node.as_bytes()).map_err(failed)?;
    store.set(&format!("tcp/{rank}"), listen.to_string().as_bytes()).map_err(failed)?;
    let mut addrs = Vec::with_capacity(env.world_size);
    let mut nodes = Vec::with_capacity(env.world_size);
    for peer in 0..env.world_size {
        if peer == rank {
            addrs.push(listen);
            nodes.push(node.to_string());
            continue;
        }
        // Rank 0 hosts the store and exits when it gives up: it waits a little longer than the
        // others, so that they hear the store's own answer (and name every missing rank) first.
        let grace = if rank == 0 { STORE_HOST_GRACE } else { Duration::ZERO };
        let left = deadline.saturating_duration_since(Instant::now()) + grace;
        let addr = match store.get(&format!("tcp/{peer}"), left) {
            Ok(addr) => addr,
            // The store answered that the key never came; any other failure is the store's own.
            Err(reason) if reason.contains("within the timeout") => {
                return Err(failed(never_joined(store, env, peer, timeout)))
            }
            Err(reason) if Instant::now() >= deadline => {
                return Err(failed(format!(
                    "{} never joined within {} s (timeout_s), and then the store closed: {reason}",
                    describe_ranks(&[peer], |r| guessed_node(env, r)),
                    timeout.as_secs_f64()
                )))
            }
            Err(reason) => return Err(failed(reason)),
        };
        let text = String::from_utf8_lossy(&addr).into_owned();
        let addr: SocketAddr =
            text.parse().map_err(|_| failed(format!("rank {peer} published `{text}`, not an address:port")))?;
        let node = store.get(&format!("tcp/{peer}/node"), Duration::from_secs(10)).map_err(failed)?;
        addrs.push(addr);
        nodes.push(String::from_utf8_lossy(&node).into_owned());
    }
    Ok(Directory { addrs, nodes })
}

/// The sentence naming every rank from `first` on that has not published its address, with its
/// node where the launcher's numbering tells it.
fn never_joined(store: &mut StoreClient, env: &DistEnv, first: usize, timeout: Duration) -> String {
    let missing: Vec<usize> = std::iter::once(first)
        .chain((first + 1..env.world_size).filter(|&r| r != env.rank))
        .filter(|&r| r == first || store.get(&format!("tcp/{r}"), Duration::from_millis(1)).is_err())
        .collect();
    format!(
        "{} never joined the rendezvous at {} within {} s (timeout_s)",
        describe_ranks(&missing, |r| guessed_node(env, r)),
        store.place,
        timeout.as_secs_f64()
    )
}

/// torchrun and Slurm number ranks node by node: when this rank's own node agrees with
/// `rank / local_world_size`, the same rule gives another rank's node.
fn guessed_node(env: &DistEnv, rank: usize) -> Option<usize> {
    let per_node = env.local_world_size.max(1);
    let node = env.node_rank?;
    (env.world_size.is_multiple_of(per_node) && env.rank / per_node == node).then_some(rank / per_node)
}

/// "rank 3", "ranks 2, 3 (node 1)", "ranks 1 (node 0), 2, 3 (node 1)": runs of ranks that share
/// a known node are named with it.
pub(super) fn describe_ranks(ranks: &[usize], node_of: impl Fn(usize) -> Option<usize>) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut run: Vec<usize> = Vec::new();
    let mut flush = |run: &mut Vec<usize>, node: Option<usize>| {
        if run.is_empty() {
            return;
        }
        let list = run.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
        parts.push(match node {
            Some(node) => format!("{list} (node {node})"),
            None => list,
        });
        run.clear();
    };
    let mut run_node = None;
    for &rank in ranks {
        let node = node_of(rank);
        if node != run_node {
            flush(&mut run, run_node);
            run_node = node;
        }
        run.push(rank);
    }
    flush(&mut run, run_node);
    let word = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_ranks_are_named_with_their_nodes() {
        assert_eq!(describe_ranks(&[3], |_| None), "rank 3");
        assert_eq!(describe_ranks(&[2, 3], |r| Some(r / 2)), "ranks 2, 3 (node 1)");
        assert_eq!(describe_ranks(&[1, 2, 3], |r| Some(r / 2)), "ranks 1 (node 0), 2, 3 (node 1)");
    }

    #[test]
    fn a_node_is_guessed_only_when_the_numbering_agrees() {
        let mut env = DistEnv { rank: 1, world_size: 4, local_world_size: 2, node_rank: Some(0), ..DistEnv::single() };
        assert_eq!(guessed_node(&env, 3), Some(1));
        env.node_rank = Some(1);
        assert_eq!(guessed_node(&env, 3), None);
        env.node_rank = None;
        assert_eq!(guessed_node(&env, 3), None);
    }

    #[test]
    fn loopback_routes_through_loopback() {
        assert_eq!(local_ip_towards("127.0.0.1", 9, 0).unwrap(), "127.0.0.1".parse::<IpAddr>().unwrap());
    }
}
