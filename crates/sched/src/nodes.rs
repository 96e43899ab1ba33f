//! Where a simulated job's workers sit when the cluster is made of nodes (`--slots-per-node`):
//! a job that grows fills the nodes it holds first, then whole free nodes, then the fullest node
//! that holds the rest (best fit); one that shrinks leaves the nodes it holds fewest on first. A job on more nodes than its workers need
//! is spread, and a step table with spread measurements makes it slower there.

#[derive(Debug, Clone)]
pub struct Nodes {
    per_node: usize,
    free: Vec<usize>,
    /// Per job, its workers on each node.
    held: Vec<Vec<usize>>,
}

impl Nodes {
    pub fn new(slots: usize, per_node: usize, jobs: usize) -> Nodes {
        let n = slots.div_ceil(per_node);
        let free = (0..n).map(|i| per_node.min(slots - i * per_node)).collect();
        Nodes { per_node, free, held: vec![vec![0; n]; jobs] }
    }

    /// Moves job `job` to `target` workers. Shrink every job first, then grow: the slots a grow
    /// takes must be free.
    pub fn resize(&mut self, job: usize, target: usize) {
        let held = &mut self.held[job];
        let mut now: usize = held.iter().sum();
        while now > target {
            let node = (0..held.len()).filter(|&i| held[i] > 0).min_by_key(|&i| held[i]).expect("holds a slot");
            held[node] -= 1;
            self.free[node] += 1;
            now -= 1;
        }
        while now < target {
            let need = target - now;
            let free = &self.free;
            let open = || (0..held.len()).filter(|&i| free[i] > 0);
            // Its own nodes first; then a whole free node for each full node's worth it needs; then
            // the fullest node that still holds the rest (best fit), so whole nodes stay whole for
            // the jobs that need them; else the freest (it must spread).
            let node = open()
                .filter(|&i| held[i] > 0)
                .max_by_key(|&i| free[i])
                .or_else(|| open().find(|&i| need >= self.per_node && free[i] == self.per_node))
                .or_else(|| open().filter(|&i| free[i] >= need).min_by_key(|&i| (free[i], i)))
                .or_else(|| open().max_by_key(|&i| (free[i], std::cmp::Reverse(i))))
                .expect("a grow never takes more slots than are free");
            let take = need.min(self.free[node]);
            held[node] += take;
            self.free[node] -= take;
            now += take;
        }
        // Invariant: a node never hands out more slots than it has.
        debug_assert!(self.free.iter().all(|&f| f <= self.per_node));
    }

    /// The nodes the job is on, where that is more than the fewest its workers fit on.
    pub fn spread(&self, job: usize) -> Option<usize> {
        let held = &self.held[job];
        let (workers, nodes) = (held.iter().sum::<usize>(), held.iter().filter(|&&h| h > 0).count());
        (nodes > workers.div_ceil(self.per_node)).then_some(nodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_packs_where_it_can_and_spreads_where_it_must() {
        let mut nodes = Nodes::new(8, 4, 3);
        nodes.resize(0, 3);
        nodes.resize(1, 3);
        assert_eq!((nodes.spread(0), nodes.spread(1)), (None, None));
        // 2 left: one on each node.
        nodes.resize(2, 2);
        assert_eq!(nodes.spread(2), Some(2));
        // Best fit: a job of 1 takes the fuller node, and a job of 4 then finds a whole one.
        let mut fit = Nodes::new(8, 4, 3);
        fit.resize(0, 3);
        fit.resize(1, 1);
        fit.resize(2, 4);
        assert_eq!((fit.held[1].clone(), fit.spread(2)), (vec![1, 0], None));
        nodes.resize(0, 1);
        nodes.resize(2, 4);
        assert_eq!(nodes.held[2].iter().sum::<usize>(), 4);
        assert_eq!(nodes.free.iter().sum::<usize>(), 0);
    }
}
