//! Interleaved 1F1B (Megatron-LM's virtual stages) as rounds: a stage holds `v` model chunks
//! (chunk c of stage s is virtual stage c x p + s), and each round computes one forward, one
//! forward and one backward, or one backward, then sends what it made and receives what its
//! neighbours send in the same round, all in one batch of point-to-point transfers. The order of
//! the virtual micro-batches and when a stage receives follow Megatron-LM's
//! `forward_backward_pipelining_with_interleaving` (without its overlap options).
//!
//! Which message a receive gets is worked out here, once, from every stage's rounds: the
//! messages between two stages match in order, so the k-th receive from a peer is that peer's
//! k-th send to this stage. A plan whose kinds or chunks would not line up is refused, and the
//! unit tests run every plan against blocking transfers (a send completes only when its receive
//! is posted) to show it cannot deadlock.

/// A stage's work on one chunk: the forward or the backward of a micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Task {
    pub forward: bool,
    pub chunk: usize,
    pub micro: usize,
}

/// A message: activations (`forward`) or their gradients, for the receiver's `chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Message {
    pub forward: bool,
    pub chunk: usize,
    pub micro: usize,
}

/// One round: its tasks, then one batch: the forward's output to the next stage, the backward's
/// input gradient to the previous one, and the receives (with what each brings).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Round {
    pub tasks: Vec<Task>,
    pub send_next: Option<Message>,
    pub send_prev: Option<Message>,
    pub recv_prev: Option<Message>,
    pub recv_next: Option<Message>,
}

/// Every stage's rounds for `stages` stages of `chunks` chunks over `micro` micro-batches (a
/// multiple of the stages, as Megatron-LM requires).
pub(crate) fn interleaved(stages: usize, chunks: usize, micro: usize) -> Result<Vec<Vec<Round>>, String> {
    let (p, v, m) = (stages, chunks, micro);
    if p < 2 || v < 1 || m == 0 || m % p != 0 {
        return Err(format!(
            "the interleaved schedule needs micro-batches (train.grad_accum, {m}) a multiple of the stages ({p})"
        ));
    }
    let mut plans: Vec<Vec<Round>> = (0..p).map(|s| stage_rounds(s, p, v, m)).collect();
    fill_receives(&mut plans)?;
    Ok(plans)
}

/// The chunk of virtual micro-batch `k` (Python's modulo: Megatron-LM asks for negative ones).
fn chunk_of(k: i64, p: usize, v: usize, forward: bool) -> usize {
    let c = (k.rem_euclid((p * v) as i64) as usize) / p;
    if forward {
        c
    } else {
        v - 1 - c
    }
}

fn micro_of(k: usize, p: usize, v: usize) -> usize {
    k / (p * v) * p + k % p
}

/// Stage `s`'s rounds, its receives marked by the chunk they feed (their micro-batch is filled by
/// `fill_receives`).
fn stage_rounds(s: usize, p: usize, v: usize, m: usize) -> Vec<Round> {
    let total = m * v;
    let all_warmup = m == p;
    let warmup = if all_warmup { total } else { ((p - s - 1) * 2 + (v - 1) * p).min(total) };
    let remaining = total - warmup;
    let (first, last) = (s == 0, s + 1 == p);
    let task =
        |k: usize, forward: bool| Task { forward, chunk: chunk_of(k as i64, p, v, forward), micro: micro_of(k, p, v) };
    let message = |forward: bool, chunk: usize| Message { forward, chunk, micro: usize::MAX };
    // A forward's output goes on unless it is the model's last chunk; a backward's input
    // gradient goes back unless it is the first. Past the last stage a chunk's output feeds the
    // first stage's next chunk; before the first stage a gradient goes to the last one's previous.
    let out = |t: Task| {
        (!(last && t.chunk == v - 1)).then_some(Message {
            forward: true,
            chunk: t.chunk + usize::from(last),
            micro: t.micro,
        })
    };
    let grad = |t: Task| {
        (!(first && t.chunk == 0)).then(|| Message {
            forward: false,
            chunk: t.chunk - usize::from(first),
            micro: t.micro,
        })
    };
    let mut rounds = Vec::with_capacity(total + warmup + 2);
    if !first {
        rounds.push(Round { recv_prev: Some(message(true, 0)), ..Round::default() });
    }
    for k in 0..warmup {
        let t = task(k, true);
        let next = chunk_of(k as i64 + 1, p, v, true);
        let recv_prev = !(first && next == 0) && k + 1 != total;
        let recv_next = k + 1 == warmup && !all_warmup && !last;
        rounds.push(Round {
            tasks: vec![t],
            send_next: out(t),
            recv_prev: recv_prev.then(|| message(true, next)),
            recv_next: recv_next.then(|| message(false, v - 1)),
            ..Round::default()
        });
    }
    for k in 0..remaining {
        let (f, b) = (task(k + warmup, true), task(k, false));
        let recv_prev = if first {
            let c = chunk_of((k + warmup) as i64 - (p as i64 - 1), p, v, true);
            (c != v - 1).then_some(c + 1)
        } else {
            Some(chunk_of((k + warmup + 1) as i64, p, v, true))
        };
        let recv_next = if last {
            let c = chunk_of(k as i64 - (p as i64 - 1), p, v, false);
            (c != 0).then(|| c - 1)
        } else {
            Some(chunk_of(k as i64 + 1, p, v, false))
        };
        let final_round = k + 1 == remaining;
        rounds.push(Round {
            tasks: vec![f, b],
            send_next: out(f),
            send_prev: grad(b),
            recv_prev: recv_prev.filter(|_| !final_round).map(|c| message(true, c)),
            recv_next: recv_next.map(|c| message(false, c)),
        });
    }
    if all_warmup && !last {
        rounds.push(Round { recv_next: Some(message(false, v - 1)), ..Round::default() });
    }
    for k in remaining..total {
        let t = task(k, false);
        let next = chunk_of(k as i64 + 1, p, v, false);
        let recv_next = !(last && next == v - 1) && k + 1 != total;
        rounds.push(Round {
            tasks: vec![t],
            send_prev: grad(t),
            recv_next: recv_next.then(|| message(false, next)),
            ..Round::default()
        });
    }
    rounds
}

/// A stage's sends over one of its links (`next`: toward the next stage) or receives over it, in
/// the order its batches post them: a round's activations before its gradients. With two stages
/// both links lead to the same peer (`both`). Returns (round, over the next link, message).
fn channel(rounds: &[Round], sends: bool, next: bool, both: bool) -> Vec<(usize, bool, Message)> {
    let mut out = Vec::new();
    for (r, round) in rounds.iter().enumerate() {
        // Activations go to the next stage and come from the previous one; gradients the other way.
        let ordered = if sends {
            [(true, round.send_next), (false, round.send_prev)]
        } else {
            [(false, round.recv_prev), (true, round.recv_next)]
        };
        for (over_next, message) in ordered {
            if let Some(m) = message.filter(|_| both || over_next == next) {
                out.push((r, over_next, m));
            }
        }
    }
    out
}

/// Matches every stage's receives with its peers' sends, in order, and writes each receive's
/// micro-batch; an unmatched or mismatched transfer is an error naming it.
fn fill_receives(plans: &mut [Vec<Round>]) -> Result<(), String> {
    let p = plans.len();
    for s in 0..p {
        for peer_is_next in [true, false] {
            let peer = if peer_is_next { (s + 1) % p } else { (s + p - 1) % p };
            let both = p == 2;
            if both && !peer_is_next {
                continue;
            }
            let receives = channel(&plans[s], false, peer_is_next, both);
            // The peer sends to this stage over its link the other way round.
            let sends = channel(&plans[peer], true, !peer_is_next, both);
            if receives.len() != sends.len() {
                return Err(format!(
                    "stage {s} would receive {} messages from stage {peer}, which sends {}",
                    receives.len(),
                    sends.len()
                ));
            }
            for ((r, from_next, want), (_, _, sent)) in receives.into_iter().zip(sends) {
                if want.forward != sent.forward || want.chunk != sent.chunk {
                    return Err(format!(
                        "stage {s} round {r} expects {want:?} from stage {peer}, which sends {sent:?}"
                    ));
                }
                let slot = if from_next { &mut plans[s][r].recv_next } else { &mut plans[s][r].recv_prev };
                *slot = Some(sent);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every stage computes every chunk's forward and backward of every micro-batch once, each
    /// forward before its backward, each input received before it is used.
    fn check_work(plans: &[Vec<Round>], v: usize, m: usize) {
        let p = plans.len();
        for (s, rounds) in plans.iter().enumerate() {
            let mut have = std::collections::HashSet::new();
            let mut done = std::collections::HashSet::new();
            for round in rounds {
                for t in &round.tasks {
                    let virtual_stage = t.chunk * p + s;
                    let needs = if t.forward { virtual_stage > 0 } else { virtual_stage + 1 < p * v };
                    if needs {
                        assert!(have.remove(&(t.forward, t.chunk, t.micro)), "stage {s}: {t:?} before its input");
                    }
                    if !t.forward {
                        assert!(done.contains(&(true, t.chunk, t.micro)), "stage {s}: {t:?} before its forward");
                    }
                    assert!(done.insert((t.forward, t.chunk, t.micro)), "stage {s}: {t:?} twice");
                }
                for m in [round.recv_prev, round.recv_next].into_iter().flatten() {
                    assert!(have.insert((m.forward, m.chunk, m.micro)), "stage {s}: {m:?} twice");
                }
            }
            assert_eq!(done.len(), 2 * v * m, "stage {s}");
            assert!(have.is_empty(), "stage {s} received what it never used: {have:?}");
        }
    }

    /// Runs the plans with blocking transfers: a transfer completes only when its counterpart is
    /// posted, in order per direction and pair; a stage moves to its next round once all of its
    /// round's transfers completed. Panics on a deadlock.
    fn run_blocking(plans: &[Vec<Round>]) {
        let p = plans.len();
        // Per stage, per round: the transfers as (peer, is_send).
        let posted: Vec<Vec<Vec<(usize, bool)>>> = plans
            .iter()
            .enumerate()
            .map(|(s, rounds)| {
                rounds
                    .iter()
                    .map(|r| {
                        let (next, prev) = ((s + 1) % p, (s + p - 1) % p);
                        // The batch's order: activations before gradients, on both ends.
                        [
                            (r.send_next, next, true),
                            (r.recv_prev, prev, false),
                            (r.send_prev, prev, true),
                            (r.recv_next, next, false),
                        ]
                        .into_iter()
                        .filter_map(|(m, peer, send)| m.map(|_| (peer, send)))
                        .collect()
                    })
                    .collect()
            })
            .collect();
        // A transfer's place in its direction: the n-th send from a to b meets the n-th receive
        // of b from a.
        let mut at = vec![0usize; p];
        let mut done: Vec<Vec<bool>> = vec![Vec::new(); p];
        let mut count = std::collections::HashMap::<(usize, usize, bool), usize>::new();
        let mut index: Vec<Vec<usize>> = vec![Vec::new(); p];
        let start_round = |s: usize, at: &[usize], count: &mut std::collections::HashMap<_, usize>| {
            posted[s].get(at[s]).map(|ops| {
                ops.iter()
                    .map(|&(peer, send)| {
                        let key = if send { (s, peer, true) } else { (peer, s, false) };
                        let n = count.entry(key).or_insert(0);
                        *n += 1;
                        *n - 1
                    })
                    .collect::<Vec<_>>()
            })
        };
        for s in 0..p {
            index[s] = start_round(s, &at, &mut count).unwrap_or_default();
            done[s] = vec![false; index[s].len()];
        }
        loop {
            let mut moved = false;
            for s in 0..p {
                let Some(ops) = posted[s].get(at[s]) else { continue };
                for (i, &(peer, send)) in ops.iter().enumerate() {
                    if done[s][i] {
                        continue;
                    }
                    // The counterpart: the peer's current round holds the opposite transfer
                    // with the same place in the same direction.
                    let Some(theirs) = posted[peer].get(at[peer]) else { continue };
                    if let Some(j) = theirs
                        .iter()
                        .enumerate()
                        .position(|(j, &(q, their_send))| q == s && their_send != send && index[peer][j] == index[s][i])
                    {
                        done[s][i] = true;
                        done[peer][j] = true;
                        moved = true;
                    }
                }
            }
            for s in 0..p {
                if at[s] < posted[s].len() && done[s].iter().all(|&d| d) {
                    at[s] += 1;
                    index[s] = start_round(s, &at, &mut count).unwrap_or_default();
                    done[s] = vec![false; index[s].len()];
                    moved = true;
                }
            }
            if (0..p).all(|s| at[s] == posted[s].len()) {
                return;
            }
            assert!(moved, "deadlock: rounds {at:?} of {:?}", posted.iter().map(Vec::len).collect::<Vec<_>>());
        }
    }

    #[test]
    fn every_interleaved_plan_does_its_work_once_and_cannot_deadlock() {
        for p in 2..=5 {
            for v in 1..=4 {
                for m in (p..=4 * p).step_by(p) {
                    let plans = interleaved(p, v, m).unwrap_or_else(|e| panic!("p {p} v {v} m {m}: {e}"));
                    check_work(&plans, v, m);
                    run_blocking(&plans);
                }
            }
        }
        assert!(interleaved(2, 2, 3).unwrap_err().contains("multiple of the stages (2)"));
    }

    /// The check above catches a plan that does deadlock: two stages that each send before
    /// they receive, in separate rounds.
    #[test]
    #[should_panic(expected = "deadlock")]
    fn sending_before_receiving_in_separate_rounds_deadlocks() {
        let message = Message { forward: true, chunk: 1, micro: 0 };
        let stage = vec![
            Round { send_next: Some(message), ..Round::default() },
            Round { recv_prev: Some(message), ..Round::default() },
        ];
        run_blocking(&[stage.clone(), stage]);
    }

    #[test]
    fn two_stages_of_two_chunks_follow_megatron_lms_order() {
        let plans = interleaved(2, 2, 4).unwrap();
        let order = |s: usize| -> Vec<String> {
            plans[s]
                .iter()
                .flat_map(|r| {
                    r.tasks.iter().map(|t| format!("{}{}.{}", if t.forward { 'F' } else { 'B' }, t.chunk, t.micro))
                })
                .collect()
        };
        // Stage 0 warms up with 4 forwards (2 (p - 1) + (v - 1) p), stage 1 with 2.
        assert_eq!(
            order(0),
            [
                "F0.0", "F0.1", "F1.0", "F1.1", "F0.2", "B1.0", "F0.3", "B1.1", "F1.2", "B0.0", "F1.3", "B0.1", "B1.2",
                "B1.3", "B0.2", "B0.3"
            ]
        );
        assert_eq!(
            order(1),
            [
                "F0.0", "F0.1", "F1.0", "B1.0", "F1.1", "B1.1", "F0.2", "B0.0", "F0.3", "B0.1", "F1.2", "B1.2", "F1.3",
                "B1.3", "B0.2", "B0.3"
            ]
        );
        // The in-flight bound: at most 2 (p - s - 1) + (v - 1) p + 1 forwards ahead of their backward.
        for (s, rounds) in plans.iter().enumerate() {
            let mut alive = 0i64;
            let mut most = 0;
            for t in rounds.iter().flat_map(|r| &r.tasks) {
                alive += if t.forward { 1 } else { -1 };
                most = most.max(alive);
            }
            assert!(most <= (2 * (2 - s - 1) + 2 + 1) as i64, "stage {s}: {most}");
        }
    }
}
