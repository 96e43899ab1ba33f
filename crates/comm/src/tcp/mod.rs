//! The `tcp` backend: TCP between nodes, shared memory inside a node.
//!
//! Each rank listens on an ephemeral port of the address that routes to MASTER_ADDR and publishes
//! it, with its node, in the TCP store ([`rendezvous`]). A group (the world or a sub-group) whose
//! members all share a node runs on the shm engine; one that spans nodes gets a TCP link per pair
//! of members ([`connect`]) and runs the ring collectives of [`mesh`]. An all-reduce over a group
//! that spans nodes with several members on some node goes hierarchically: a shared-memory
//! all-reduce inside each node, a TCP ring among one leader per node, and a shared-memory
//! broadcast from each leader.
//!
//! When a rank finds a peer lost it tells the peers it still has links to (an abort header naming
//! the lost rank, and on its node the shared-memory segments' abort word) before it gives up, so
//! ranks that never talked to the lost one name it too.

mod connect;
mod mesh;
mod rendezvous;
mod wire;

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use crate::api::{Communicator, ProcessGroup};
use crate::config::{CommConfig, DistEnv};
use crate::dtype::{self, ReduceOp};
use crate::error::{CommError, Result};
use crate::shm::{Rendezvous, ShmEngine};
use crate::work::{self, Engine, GroupInfo, Op};

use connect::Switchboard;
use mesh::Mesh;

/// Builds the communicator of this process: the rendezvous and the world group run on the calling
/// thread, then the engine moves to the communication thread.
pub(crate) fn connect(config: &CommConfig, env: &DistEnv) -> Result<Box<dyn Communicator>> {
    let engine = TcpEngine::new(config.clone(), env)?;
    let backend = engine.groups[0].backend();
    let (rank, size) = (env.rank, env.world_size);
    let worker = work::Worker::spawn(rank, "tcp", move || Ok(Box::new(engine) as Box<dyn Engine>))?;
    Ok(Box::new(ProcessGroup { worker, group: 0, rank, size, backend }))
}

/// How one group moves its bytes.
enum Transport {
    /// A group of one: every operation is local.
    Single,
    /// All members share a node: a group of the shm engine.
    Shm(usize),
    /// The members span nodes.
    Tcp { mesh: Mesh, hierarchy: Option<Hierarchy> },
}

/// The parts of the hierarchical all-reduce, for a group spanning nodes with several members on
/// some node.
struct Hierarchy {
    /// The shm group of this rank's node-mates in the group (`None` when it is alone there).
    local: Option<usize>,
    /// The links among one leader (lowest rank) per node, on leaders only.
    leaders: Option<Mesh>,
}

struct Group {
    key: String,
    /// Group rank -> world rank, ascending.
    world_ranks: Vec<usize>,
    rank: usize,
    children: u32,
    transport: Transport,
}

impl Group {
    fn backend(&self) -> &'static str {
        match self.transport {
            Transport::Single | Transport::Shm(_) => "shm",
            Transport::Tcp { .. } => "tcp",
        }
    }
}

pub(crate) struct TcpEngine {
    /// This process's world rank.
    rank: usize,
    timeout: Duration,
    /// Node name per world rank.
    nodes: Vec<String>,
    switchboard: Switchboard,
    shm: ShmEngine,
    groups: Vec<Group>,
}

impl TcpEngine {
    fn new(config: CommConfig, env: &DistEnv) -> Result<TcpEngine> {
        let timeout = Duration::from_secs_f64(config.timeout_s);
        let deadline = Instant::now() + timeout;
        let rank = env.rank;
        if env.world_size == 1 {
            // A world of one needs no rendezvous; the shm engine never builds a segment for it.
            let listener = bind(rank, "127.0.0.1:0".parse().expect("literal"))?;
            let addr = listener.local_addr().map_err(|e| CommError::io("read the address of", "tcp listener", e))?;
            let rendezvous = Rendezvous::Path(config.shm_dir.join("stoke-comm-single"));
            let mut engine = TcpEngine {
                rank,
                timeout,
                nodes: vec![rendezvous::node_identity(env)],
                switchboard: Switchboard::new(listener, vec![addr], rank, timeout),
                shm: ShmEngine::without_groups(config, rendezvous),
                groups: Vec::new(),
            };
            let world = engine.make_group("world".into(), vec![0], 0, "connect")?;
            engine.groups.push(world);
            return Ok(engine);
        }
        let (Some(addr), Some(port)) = (&env.master_addr, env.master_port) else {
            return Err(CommError::Environment(format!(
                "rank {} of {} has no rendezvous for the tcp backend: set MASTER_ADDR and MASTER_PORT \
                 (stoke launch and torchrun do)",
                env.rank, env.world_size
            )));
        };
        let ip = rendezvous::local_ip_towards(addr, port, rank)?;
        let listener = bind(rank, SocketAddr::new(ip, 0))?;
        let listen = listener.local_addr().map_err(|e| CommError::io("read the address of", "tcp listener", e))?;
        let mut store = crate::store::rendezvous(addr, port, rank, deadline)?;
        let node = rendezvous::node_identity(env);
        let directory = rendezvous::exchange(&mut store, env, listen, &node, timeout, deadline)?;
        let mut engine = TcpEngine {
            rank,
            timeout,
            nodes: directory.nodes,
            switchboard: Switchboard::new(listener, directory.addrs, rank, timeout),
            shm: ShmEngine::without_groups(config, Rendezvous::Store(store)),
            groups: Vec::new(),
        };
        let world = engine.make_group("world".into(), (0..env.world_size).collect(), rank, "connect")?;
        engine.groups.push(world);
        Ok(engine)
    }

    fn one_node(&self, world_ranks: &[usize]) -> bool {
        world_ranks.iter().all(|&r| self.nodes[r] == self.nodes[world_ranks[0]])
    }

    /// Builds group `key` of `world_ranks` (ascending), this process being member `me`.
    /// Collective over the members.
    fn make_group(&mut self, key: String, world_ranks: Vec<usize>, me: usize, op: &'static str) -> Result<Group> {
        let transport = if world_ranks.len() == 1 {
            Transport::Single
        } else if self.one_node(&world_ranks) {
            Transport::Shm(self.shm.add_group(world_ranks.clone(), me, format!("tcp/{key}"))?)
        } else {
            let links = self.switchboard.links(&key, &world_ranks, me, op)?;
            let mesh = Mesh::new(links, world_ranks.clone(), me, self.timeout);
            let hierarchy = self.make_hierarchy(&key, &world_ranks, op)?;
            Transport::Tcp { mesh, hierarchy }
        };
        Ok(Group { key, world_ranks, rank: me, children: 0, transport })
    }

    /// The node-local shm group and the leaders' links of a group spanning nodes, when some node
    /// holds several of its members (else a flat ring is all there is to do).
    fn make_hierarchy(&mut self, key: &str, world_ranks: &[usize], op: &'static str) -> Result<Option<Hierarchy>> {
        // Nodes in order of their lowest member; each node's members ascending.
        let mut by_node: Vec<(String, Vec<usize>)> = Vec::new();
        for &r in world_ranks {
            match by_node.iter_mut().find(|(node, _)| *node == self.nodes[r]) {
                Some((_, members)) => members.push(r),
                None => by_node.push((self.nodes[r].clone(), vec![r])),
            }
        }
        if by_node.iter().all(|(_, members)| members.len() == 1) {
            return Ok(None);
        }
        let node_idx = by_node.iter().position(|(node, _)| *node == self.nodes[self.rank]).expect("this rank's node");
        let mates = by_node[node_idx].1.clone();
        let me_local = mates.iter().position(|&r| r == self.rank).expect("this rank is on its node");
        let local = if mates.len() > 1 {
            Some(self.shm.add_group(mates, me_local, format!("tcp/{key}/node{node_idx}"))?)
        } else {
            None
        };
        let leaders: Vec<usize> = by_node.iter().map(|(_, members)| members[0]).collect();
        let leaders = if me_local == 0 {
            let links = self.switchboard.links(&format!("{key}/leaders"), &leaders, node_idx, op)?;
            Some(Mesh::new(links, leaders, node_idx, self.timeout))
        } else {
            None
        };
        Ok(Some(Hierarchy { local, leaders }))
    }

    fn new_group(&mut self, group: usize, ranks: &[usize]) -> Result<Option<GroupInfo>> {
        let parent = &mut self.groups[group];
        parent.children += 1;
        let key = format!("{}/{}", parent.key, parent.children);
        let Some(me) = ranks.iter().position(|&r| r == parent.rank) else {
            return Ok(None);
        };
        let world_ranks: Vec<usize> = ranks.iter().map(|&r| parent.world_ranks[r]).collect();
        let size = world_ranks.len();
        let child = self.make_group(key, world_ranks, me, "new_group")?;
        let backend = Some(child.backend());
        self.groups.push(child);
        Ok(Some(GroupInfo { id: self.groups.len() - 1, rank: me, size, backend }))
    }

    /// Tells every peer this rank has a link to that it gives up because `lost_rank` was lost:
    /// over TCP an abort header, and on this node's shared memory the segments' abort word (so a
    /// rank waiting there for this one names `lost_rank`, not this rank).
    fn abort_all(&self, lost_rank: usize) {
        self.shm.abort_outside(lost_rank);
        for group in &self.groups {
            if let Transport::Tcp { mesh, hierarchy } = &group.transport {
                let leaders = hierarchy.as_ref().and_then(|h| h.leaders.as_ref());
                for link in mesh.links().chain(leaders.into_iter().flat_map(Mesh::links)) {
                    if link.peer != lost_rank {
                        link.abort(lost_rank);
                    }
                }
            }
        }
    }

    fn run(&mut self, group: usize, op: &Op) -> Result<()> {
        let name = op.name();
        let g = &mut self.groups[group];
        let (mesh, hierarchy) = match &mut g.transport {
            Transport::Single => {
                if let Op::AllToAll { send, recv } = op {
                    // SAFETY: both regions hold count elements and do not overlap (checked before
                    // queueing).
                    unsafe { std::ptr::copy_nonoverlapping(send.ptr() as *const u8, recv.ptr(), send.bytes()) };
                }
                // Every other operation on a group of one is the identity (avg divides by 1).
                return Ok(());
            }
            Transport::Shm(id) => return self.shm.execute(*id, op).map(|_| ()),
            Transport::Tcp { mesh, hierarchy } => (mesh, hierarchy),
        };
        match op {
            Op::AllReduce { region, op: reduce } => match hierarchy {
                Some(h) => hierarchical_all_reduce(&mut self.shm, h, mesh.size, region, *reduce),
                None => mesh.all_reduce(name, region, *reduce),
            },
            Op::ReduceScatter { region, op } => mesh.ring(name, region, Some(*op), false),
            Op::AllGather { region } => mesh.ring(name, region, None, true),
            Op::Broadcast { region, root } => mesh.broadcast(name, region, *root),
            Op::AllToAll { send, recv } => mesh.all_to_all(name, send, recv),
            Op::Send { region, peer } => mesh.send(name, region, *peer),
            Op::Recv { region, peer } => mesh.recv(name, region, *peer),
            Op::Batch(ops) => mesh.batch(name, ops),
            Op::Barrier => mesh.barrier(name),
            Op::NewGroup { .. } => unreachable!("handled by execute"),
        }
    }
}

/// Sum inside the node over shared memory, sum among the node leaders over TCP (the leader divides
/// for an average), then each leader broadcasts the result to its node.
fn hierarchical_all_reduce(
    shm: &mut ShmEngine,
    hierarchy: &mut Hierarchy,
    group_size: usize,
    region: &work::Region,
    reduce: ReduceOp,
) -> Result<()> {
    if let Some(local) = hierarchy.local {
        shm.execute(local, &Op::AllReduce { region: *region, op: ReduceOp::Sum })?;
    }
    if let Some(leaders) = &mut hierarchy.leaders {
        leaders.all_reduce("all_reduce", region, ReduceOp::Sum)?;
        if reduce == ReduceOp::Avg {
            // SAFETY: the region is the caller's, valid and untouched by others until completion.
            unsafe { dtype::divide(region.dtype(), region.ptr(), region.count(), group_size as f32) };
        }
    }
    if let Some(local) = hierarchy.local {
        shm.execute(local, &Op::Broadcast { region: *region, root: 0 })?;
    }
    Ok(())
}

impl Engine for TcpEngine {
    fn execute(&mut self, group: usize, op: &Op) -> Result<Option<GroupInfo>> {
        let outcome = match op {
            Op::NewGroup { ranks } => self.new_group(group, ranks),
            _ => self.run(group, op).map(|_| None),
        };
        if let Err(CommError::PeerLost { lost_rank, .. }) = &outcome {
            self.abort_all(*lost_rank);
        }
        outcome
    }
}

fn bind(rank: usize, addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| CommError::Rendezvous {
        rank,
        place: addr.to_string(),
        reason: format!("cannot listen for peers: {e}"),
    })
}
