//! One step of a pipeline stage (`dist.pipeline`): the step's micro-batches through this stage's
//! units in the schedule's order, activations received from the previous stage and sent to the
//! next, their gradients back.
//!
//! Every stage reads the same micro-batches from its own source (the first stage needs the
//! tokens, the last the targets), so the sources stay at one position. Transfers run in the
//! schedule's order. Under 1F1B two neighbours want to send to each other at once (the forward's
//! output one way, the backward's input gradient the other): a stage's send goes out in one
//! batch (`p2p_batch_async`) with its next work's receive from the same peer, as Megatron-LM
//! pairs them, so the two transfers progress together and neither neighbour waits on the other.
//! A message is a header (kind, shape, micro-batch) and its payload, received together: the
//! receiver knows the size ahead (a gradient has the shape of the output it answers, activations
//! the shape of the step's first, whose header is read alone). Waiting on a neighbour is charged
//! to `comm_exposed`: a stage's share of it is the bubble plus the transfers.
//!
//! Interleaved 1F1B runs the rounds of `super::rounds`: a stage holds several chunks, and each
//! round's sends and receives (to and from both neighbours, the last stage's output wrapping to
//! the first) go out as one batch.

use stoke_comm::{Communicator, DType, P2p, Region};
use stoke_data::BatchSource;
use stoke_prof::Phase;
use tch::{Device, Kind, Tensor};

use crate::clock::StepClock;
use crate::dist::{Schedule, StageLink};
use crate::executor::{Forwarded, StageInput, StepHooks};
use crate::models::Inputs;
use crate::TrainError;

use super::events::MemoryReport;
use super::state::Trainer;

/// A stage's work, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Work {
    Forward(usize),
    Backward(usize),
}

/// Stage `stage` of `stages`' order of forwards and backwards over `m` micro-batches.
pub(crate) fn schedule(schedule: Schedule, stage: usize, stages: usize, m: usize) -> Vec<Work> {
    match schedule {
        Schedule::GPipe => (0..m).map(Work::Forward).chain((0..m).map(Work::Backward)).collect(),
        Schedule::Interleaved { .. } => unreachable!("interleaved stages run rounds (`super::rounds`)"),
        Schedule::OneFOneB => {
            let warmup = (stages - stage - 1).min(m);
            let mut order: Vec<Work> = (0..warmup).map(Work::Forward).collect();
            for i in 0..m - warmup {
                order.push(Work::Forward(warmup + i));
                order.push(Work::Backward(i));
            }
            order.extend((m - warmup..m).map(Work::Backward));
            order
        }
    }
}

/// Header words of an activation message: kind, rank, four dimensions, micro-batch, elements.
const HEADER: usize = 8;

fn kind_code(kind: Kind) -> Result<u64, String> {
    match kind {
        Kind::Float => Ok(0),
        Kind::BFloat16 => Ok(1),
        Kind::Half => Ok(2),
        other => Err(format!("an activation of kind {other:?} cannot cross a pipeline stage")),
    }
}

/// A tensor's kind and shape as a message carries them.
type Layout = (Kind, Vec<i64>);

/// A stage's link to its neighbours. Every transfer is a header and a payload; what a stage sends
/// and what it receives next go out as one batch (`p2p_batch_async`), so neighbours that send
/// to each other at once never wait on each other.
struct Link<'a> {
    link: &'a StageLink,
    device: Device,
    /// The layout of the activations the previous stage sends (learned from the first) and of the
    /// gradients the next one sends back (this stage's output's): a receive's size before it starts.
    activations: Option<Layout>,
    gradients: Option<Layout>,
    /// Time spent blocked sending and receiving.
    waited: std::time::Duration,
}

fn invalid(message: String) -> TrainError {
    TrainError::InvalidConfig { key: "dist.pipeline", message }
}

impl<'a> Link<'a> {
    fn comm(&self) -> &dyn Communicator {
        self.link.comm.as_ref()
    }

    fn error(&self, op: &'static str) -> impl FnOnce(stoke_comm::CommError) -> TrainError + '_ {
        move |source| TrainError::Comm { rank: self.comm().rank(), world_size: self.comm().world_size(), op, source }
    }

    /// Sends `out` (a peer, a tensor and its micro-batch) and receives `inbound` (a peer and the
    /// micro-batch expected from it) together; returns what was received, on this stage's device.
    fn exchange(
        &mut self,
        out: Option<(usize, &Tensor, usize)>,
        inbound: Option<(usize, usize)>,
    ) -> Result<Option<Tensor>, TrainError> {
        let stage = self.link.stage;
        let outs: Vec<Out> = out
            .map(|(peer, tensor, micro)| Out { peer, tensor, tag: micro as u64, forward: peer > stage })
            .into_iter()
            .collect();
        let ins: Vec<In> =
            inbound.map(|(peer, micro)| In { peer, tag: micro as u64, forward: peer < stage }).into_iter().collect();
        Ok(self.batch(&outs, &ins)?.pop())
    }

    /// Sends `outs` and receives `ins` in one batch, timed; returns the receives' tensors in order.
    fn batch(&mut self, outs: &[Out], ins: &[In]) -> Result<Vec<Tensor>, TrainError> {
        let start = std::time::Instant::now();
        let result = self.transfer(outs, ins);
        self.waited += start.elapsed();
        result
    }

    /// `batch` without its timing.
    fn transfer(&mut self, outs: &[Out], ins: &[In]) -> Result<Vec<Tensor>, TrainError> {
        let op = match (outs, ins) {
            ([], [In { forward: true, .. }]) => "receive activations from the previous stage",
            ([], [In { forward: false, .. }]) => "receive gradients from the next stage",
            ([Out { forward: true, .. }], []) => "send activations to the next stage",
            ([Out { forward: false, .. }], []) => "send gradients to the previous stage",
            _ => "send to and receive from the neighbour stages",
        };
        let mut outbound = Vec::with_capacity(outs.len());
        for out in outs {
            let host = out.tensor.to_device(Device::Cpu).contiguous();
            let size = host.size();
            if size.len() > 4 {
                return Err(invalid(format!("an activation of {} dimensions cannot cross a stage", size.len())));
            }
            let mut header = [0u64; HEADER];
            header[0] = kind_code(host.kind()).map_err(invalid)?;
            header[1] = size.len() as u64;
            for (i, &d) in size.iter().enumerate() {
                header[2 + i] = d as u64;
            }
            header[6] = out.tag;
            header[7] = host.numel() as u64;
            // Its gradient comes back in its layout; every activation between stages has it.
            if out.forward {
                self.gradients = Some((host.kind(), size.clone()));
                self.activations.get_or_insert((host.kind(), size));
            }
            let bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
            outbound.push((out.peer, bytes, host));
        }
        let mut headers = vec![[0u8; 8 * HEADER]; ins.len()];
        let mut read_alone = false;
        let mut expected = Vec::with_capacity(ins.len());
        for (i, inbound) in ins.iter().enumerate() {
            let known = if inbound.forward { &self.activations } else { &self.gradients };
            expected.push(match known.clone() {
                Some(layout) => layout,
                // The run's first activations: a stage's first transfer, a receive alone, so its
                // header can be read first to size the payload.
                None if outs.is_empty() && ins.len() == 1 && inbound.forward => {
                    stoke_comm::CommunicatorExt::recv(self.comm(), &mut headers[i], inbound.peer)
                        .map_err(self.error(op))?;
                    read_alone = true;
                    let layout = self.check_header(&headers[i], inbound, None)?;
                    self.activations = Some(layout.clone());
                    layout
                }
                None => {
                    return Err(invalid(format!(
                        "stage {} would receive from stage {} before it knows the message's size",
                        self.link.stage, inbound.peer
                    )))
                }
            });
        }
        let mut ops = Vec::with_capacity(2 * (outs.len() + ins.len()));
        for (peer, bytes, host) in &outbound {
            ops.push(P2p::Send { region: Region::new(bytes.as_ptr() as *mut u8, bytes.len(), DType::U8), peer: *peer });
            let payload = host.numel() * host.kind().elt_size_in_bytes();
            ops.push(P2p::Send { region: Region::new(host.data_ptr() as *mut u8, payload, DType::U8), peer: *peer });
        }
        let mut received = Vec::with_capacity(ins.len());
        for ((inbound, header), (kind, dims)) in ins.iter().zip(headers.iter_mut()).zip(&expected) {
            if !read_alone {
                ops.push(P2p::Recv { region: Region::of(&mut header[..]), peer: inbound.peer });
            }
            let host = Tensor::empty(dims.as_slice(), (*kind, Device::Cpu));
            let payload = host.numel() * kind.elt_size_in_bytes();
            ops.push(P2p::Recv {
                region: Region::new(host.data_ptr() as *mut u8, payload, DType::U8),
                peer: inbound.peer,
            });
            received.push(host);
        }
        // SAFETY: every region (the headers, `outbound`'s host tensors, the fresh receive tensors)
        // lives until `wait` returns; the receives overlap nothing else.
        unsafe { self.comm().p2p_batch_async(&ops) }.and_then(|w| w.wait()).map_err(self.error(op))?;
        if !read_alone {
            for ((inbound, header), layout) in ins.iter().zip(&headers).zip(&expected) {
                self.check_header(header, inbound, Some(layout))?;
            }
        }
        Ok(received.into_iter().map(|host| host.to_device(self.device)).collect())
    }

    /// Micro-batch `micro`'s tensor from `peer`: the one an earlier exchange brought ahead, or a
    /// receive now.
    fn take_or_receive(
        &mut self,
        ahead: &mut Option<(usize, Tensor)>,
        peer: usize,
        micro: usize,
    ) -> Result<Tensor, TrainError> {
        match ahead.take() {
            Some((held, tensor)) if held == micro => Ok(tensor),
            Some((held, _)) => Err(invalid(format!(
                "stage {} holds micro-batch {held} from stage {peer} where it needs {micro}",
                self.link.stage
            ))),
            None => Ok(self.exchange(None, Some((peer, micro)))?.expect("a receive returns its tensor")),
        }
    }

    /// The layout a received header announces, checked against the message expected (micro-batch
    /// and chunk) and its layout (a neighbour that changed shape, or a schedule out of step, is
    /// an error naming it).
    fn check_header(
        &self,
        bytes: &[u8; 8 * HEADER],
        inbound: &In,
        expected: Option<&Layout>,
    ) -> Result<Layout, TrainError> {
        let peer = inbound.peer;
        let header: Vec<u64> =
            bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let kind = match header[0] {
            0 => Kind::Float,
            1 => Kind::BFloat16,
            2 => Kind::Half,
            code => return Err(invalid(format!("stage {peer} sent an activation of unknown kind {code}"))),
        };
        let ndim = (header[1] as usize).min(4);
        let dims: Vec<i64> = header[2..2 + ndim].iter().map(|&d| d as i64).collect();
        let consistent = dims.iter().product::<i64>() as u64 == header[7];
        let as_expected = expected.is_none_or(|(k, d)| *k == kind && *d == dims);
        if header[6] != inbound.tag || !consistent || !as_expected {
            return Err(invalid(format!(
                "stage {} expected {}{} from stage {peer}, got {} of shape {dims:?} ({} elements, {kind:?})",
                self.link.stage,
                describe(inbound.tag),
                expected.map(|(k, d)| format!(" of shape {d:?} ({k:?})")).unwrap_or_default(),
                describe(header[6]),
                header[7]
            )));
        }
        Ok((kind, dims))
    }
}

/// A message's tag: its micro-batch, and the receiver's chunk above bit 32.
fn tag(chunk: usize, micro: usize) -> u64 {
    (chunk as u64) << 32 | micro as u64
}

fn describe(tag: u64) -> String {
    match tag >> 32 {
        0 => format!("micro-batch {}", tag & 0xffff_ffff),
        chunk => format!("chunk {chunk}'s micro-batch {}", tag & 0xffff_ffff),
    }
}

/// A tensor to send: to `peer`, tagged, activations (`forward`) or a gradient.
struct Out<'t> {
    peer: usize,
    tensor: &'t Tensor,
    tag: u64,
    forward: bool,
}

/// A receive: from `peer`, the message tagged `tag`, activations (`forward`) or a gradient.
struct In {
    peer: usize,
    tag: u64,
    forward: bool,
}

impl Trainer {
    /// Makes this trainer run one pipeline stage's units on `link` (`DataParallel::pipeline_stage`).
    pub fn set_stage(&mut self, link: StageLink) -> Result<(), TrainError> {
        if self.executor.kind() == crate::ExecutorKind::SingleGraph {
            return Err(TrainError::InvalidConfig {
                key: "train.executor",
                message: "is \"single-graph\", which cannot run a pipeline stage's units; use \"blocks\"".into(),
            });
        }
        if self.adaptive.is_some() {
            return Err(TrainError::InvalidConfig {
                key: "adaptive.enabled",
                message: "reads each micro-batch's whole gradient, which no pipeline stage holds".into(),
            });
        }
        if let Schedule::Interleaved { chunks } = link.schedule {
            let mut plans = super::rounds::interleaved(link.stages, chunks, self.grad_accum)
                .map_err(|message| TrainError::InvalidConfig { key: "dist.pipeline_schedule", message })?;
            self.stage_rounds = plans.swap_remove(link.stage);
        }
        self.model.interleave_micro_batches();
        self.stage = Some(link);
        Ok(())
    }

    /// `forward_backward` of a pipeline stage (`link`); see the module doc. The loss is the
    /// step's mean on the last stage and zero elsewhere (the hooks' `reduce_loss` takes the last
    /// stages').
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_stage(
        &mut self,
        link: &StageLink,
        source: &mut dyn BatchSource,
        step_number: u64,
        measure_memory: bool,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<(Tensor, Option<MemoryReport>, Option<f64>), TrainError> {
        let mut net =
            Link { link, device: self.device, activations: None, gradients: None, waited: std::time::Duration::ZERO };
        let span = std::time::Instant::now();
        self.model.begin_step_casts(false);
        let mut step = StageStep {
            source,
            step_number,
            measure_memory,
            loss_multiplier: self.scaler.as_ref().map_or(1.0, crate::precision::LossScaler::scale)
                / self.grad_accum as f64,
            n_micro: self.grad_accum,
            pending: link.chunks.iter().map(|_| std::collections::VecDeque::new()).collect(),
            inputs: std::collections::BTreeMap::new(),
            read: 0,
            loss_sum: Tensor::zeros([], (Kind::Float, self.device)),
            memory: None,
        };
        let result = match link.schedule {
            Schedule::Interleaved { chunks } => self.run_rounds(link, chunks, &mut net, &mut step, clock, hooks),
            _ => self.run_in_order(link, &mut net, &mut step, clock, hooks),
        };
        let (loss_sum, memory) = (step.loss_sum.shallow_clone(), step.memory.take());
        drop(step);
        result?;
        self.stage_times = Some((net.waited.as_secs_f64() * 1e3, span.elapsed().as_secs_f64() * 1e3));
        self.model.end_step_casts();
        Ok((loss_sum, memory, None))
    }

    /// GPipe and 1F1B: one chunk, a send paired with the next work's receive from the same peer.
    fn run_in_order<'m>(
        &'m self,
        link: &StageLink,
        net: &mut Link,
        step: &mut StageStep<'_, 'm>,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<(), TrainError> {
        let (first, last_stage) = (link.stage == 0, link.stage + 1 == link.stages);
        // What a send brought back ahead of its use: (micro-batch, tensor).
        let mut ahead: Option<(usize, Tensor)> = None;
        let order = schedule(link.schedule, link.stage, link.stages, step.n_micro);
        for (at, &work) in order.iter().enumerate() {
            // The next work's receive from the peer this work sends to goes out with the send, in
            // one batch (Megatron-LM's send_forward_recv_backward and send_backward_recv_forward).
            let next_receive = match order.get(at + 1) {
                Some(&Work::Backward(j)) if !last_stage => Some((link.stage + 1, j)),
                Some(&Work::Forward(k)) if !first => Some((link.stage - 1, k)),
                _ => None,
            };
            match work {
                Work::Forward(micro) => {
                    let input = if first {
                        None
                    } else {
                        let received = net.take_or_receive(&mut ahead, link.stage - 1, micro)?;
                        clock.lap(Phase::CommExposed);
                        Some(received)
                    };
                    if let Some(output) = self.stage_forward(link, step, 0, micro, input, clock, hooks)? {
                        let with = next_receive.filter(|(peer, _)| *peer > link.stage);
                        let got = net.exchange(Some((link.stage + 1, &output, micro)), with)?;
                        ahead = got.zip(with).map(|(tensor, (_, j))| (j, tensor));
                        clock.lap(Phase::CommExposed);
                    }
                }
                Work::Backward(micro) => {
                    let grad_output = if last_stage {
                        None
                    } else {
                        let grad = net.take_or_receive(&mut ahead, link.stage + 1, micro)?;
                        clock.lap(Phase::CommExposed);
                        Some(grad)
                    };
                    if let Some(grad) = self.stage_backward(step, 0, micro, grad_output, clock, hooks)? {
                        let with = next_receive.filter(|(peer, _)| *peer < link.stage);
                        let got = net.exchange(Some((link.stage - 1, &grad, micro)), with)?;
                        ahead = got.zip(with).map(|(tensor, (_, k))| (k, tensor));
                        clock.lap(Phase::CommExposed);
                    }
                }
            }
        }
        Ok(())
    }

    /// Interleaved 1F1B over `chunks` chunks a stage: the rounds `set_stage` planned (`super::rounds`).
    fn run_rounds<'m>(
        &'m self,
        link: &StageLink,
        chunks: usize,
        net: &mut Link,
        step: &mut StageStep<'_, 'm>,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<(), TrainError> {
        let (p, s) = (link.stages, link.stage);
        let (next, prev) = ((s + 1) % p, (s + p - 1) % p);
        // Received activations and gradients until their task: (forward, chunk, micro).
        let mut held: std::collections::HashMap<(bool, usize, usize), Tensor> = std::collections::HashMap::new();
        for round in &self.stage_rounds {
            let mut sends: Vec<(Tensor, super::rounds::Message, usize)> = Vec::with_capacity(2);
            for task in &round.tasks {
                let virtual_stage = task.chunk * p + s;
                let key = (task.forward, task.chunk, task.micro);
                if task.forward {
                    let input = if virtual_stage == 0 { None } else { Some(take_held(&mut held, key, s)?) };
                    let output = self.stage_forward(link, step, task.chunk, task.micro, input, clock, hooks)?;
                    if let (Some(output), Some(message)) = (output, round.send_next) {
                        sends.push((output, message, next));
                    }
                } else {
                    let grad = if virtual_stage + 1 == p * chunks { None } else { Some(take_held(&mut held, key, s)?) };
                    let grad_input = self.stage_backward(step, task.chunk, task.micro, grad, clock, hooks)?;
                    if let (Some(grad_input), Some(message)) = (grad_input, round.send_prev) {
                        sends.push((grad_input, message, prev));
                    }
                }
            }
            let planned = usize::from(round.send_next.is_some()) + usize::from(round.send_prev.is_some());
            if sends.len() != planned {
                return Err(invalid(format!(
                    "stage {s}'s round made {} of the {planned} tensors it sends",
                    sends.len()
                )));
            }
            // Activations before gradients, on both ends (their order between two stages).
            sends.sort_by_key(|(_, message, _)| !message.forward);
            let outs: Vec<Out> = sends
                .iter()
                .map(|(tensor, m, peer)| Out { peer: *peer, tensor, tag: tag(m.chunk, m.micro), forward: m.forward })
                .collect();
            let receives: Vec<(super::rounds::Message, usize)> =
                round.recv_prev.map(|m| (m, prev)).into_iter().chain(round.recv_next.map(|m| (m, next))).collect();
            let ins: Vec<In> = receives
                .iter()
                .map(|(m, peer)| In { peer: *peer, tag: tag(m.chunk, m.micro), forward: m.forward })
                .collect();
            if outs.is_empty() && ins.is_empty() {
                continue;
            }
            let got = net.batch(&outs, &ins)?;
            clock.lap(Phase::CommExposed);
            for ((m, _), tensor) in receives.into_iter().zip(got) {
                held.insert((m.forward, m.chunk, m.micro), tensor);
            }
        }
        Ok(())
    }

    /// Chunk `chunk`'s forward of micro-batch `micro` (its input received, or None on the
    /// embedding's chunk); returns the output the next stage receives (None from the head).
    #[allow(clippy::too_many_arguments)]
    fn stage_forward<'m>(
        &'m self,
        link: &StageLink,
        step: &mut StageStep<'_, 'm>,
        chunk: usize,
        micro: usize,
        input: Option<Tensor>,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<Option<Tensor>, TrainError> {
        // A micro-batch's rows are read at its first forward here (micro-batches start in order).
        if !step.inputs.contains_key(&micro) {
            if micro != step.read {
                return Err(invalid(format!("stage {} starts micro-batch {micro} before {}", link.stage, step.read)));
            }
            let inputs = self.next_inputs(step.source, step.step_number, clock)?;
            step.inputs.insert(micro, (inputs, 0));
            step.read += 1;
        }
        let inputs = &step.inputs[&micro].0;
        let input = match input {
            None => StageInput::Batch,
            Some(received) => StageInput::Received(received),
        };
        let measure = step.measure_memory && micro == 0 && chunk == 0;
        let before = measure.then(crate::peak::host_bytes_in_use).flatten();
        let forwarded = self.executor.forward_units(
            self.model.as_ref(),
            link.chunks[chunk].clone(),
            input,
            inputs,
            step.loss_multiplier,
            measure,
            clock,
            hooks,
        )?;
        if let (Some(before), Some(per_block), Some(peak)) =
            (before, forwarded.activation_bytes.clone(), forwarded.peak_bytes_in_use)
        {
            step.memory = Some(self.memory_report(before, per_block, peak));
        }
        let output = forwarded.output.as_ref().map(Tensor::shallow_clone);
        step.pending[chunk].push_back((micro, forwarded));
        Ok(output)
    }

    /// Chunk `chunk`'s backward of micro-batch `micro` (None: the head's, from the loss); returns
    /// the gradient the previous stage receives (None from the embedding).
    fn stage_backward<'m>(
        &'m self,
        step: &mut StageStep<'_, 'm>,
        chunk: usize,
        micro: usize,
        grad_output: Option<Tensor>,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<Option<Tensor>, TrainError> {
        let (held, forwarded) = step.pending[chunk].pop_front().expect("a backward follows its forward");
        debug_assert_eq!(held, micro, "micro-batches leave a chunk in the order they came");
        let last = micro + 1 == step.n_micro;
        let backward = self.executor.backward_units(self.model.as_ref(), forwarded, grad_output, last, clock, hooks)?;
        if let Some(loss) = backward.loss {
            step.loss_sum += loss / step.n_micro as f64;
        }
        // The micro-batch's rows go once every chunk here is done with it.
        let chunks = step.pending.len();
        if let Some(entry) = step.inputs.get_mut(&micro) {
            entry.1 += 1;
            if entry.1 == chunks {
                step.inputs.remove(&micro);
            }
        }
        Ok(backward.grad_input)
    }
}

/// What a stage's step keeps between its tasks.
struct StageStep<'s, 'm> {
    source: &'s mut dyn BatchSource,
    step_number: u64,
    measure_memory: bool,
    loss_multiplier: f64,
    n_micro: usize,
    /// Per chunk, its micro-batches between forward and backward.
    pending: Vec<std::collections::VecDeque<(usize, Forwarded<'m>)>>,
    /// Each started micro-batch's rows and how many chunks' backwards are done with them.
    inputs: std::collections::BTreeMap<usize, (Inputs, usize)>,
    /// Micro-batches read so far.
    read: usize,
    loss_sum: Tensor,
    memory: Option<MemoryReport>,
}

/// A received tensor a task needs, named when it never came.
fn take_held(
    held: &mut std::collections::HashMap<(bool, usize, usize), Tensor>,
    key: (bool, usize, usize),
    stage: usize,
) -> Result<Tensor, TrainError> {
    held.remove(&key).ok_or_else(|| {
        let (forward, chunk, micro) = key;
        let what = if forward { "activations" } else { "gradient" };
        invalid(format!("stage {stage} runs chunk {chunk}'s micro-batch {micro} without its {what}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_keeps_at_most_the_stages_ahead_in_flight() {
        let order = schedule(Schedule::OneFOneB, 0, 2, 4);
        use Work::{Backward as B, Forward as F};
        assert_eq!(order, vec![F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)]);
        assert_eq!(schedule(Schedule::OneFOneB, 1, 2, 4), vec![F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]);
        // Fewer micro-batches than stages: all forwards, then all backwards.
        assert_eq!(schedule(Schedule::OneFOneB, 0, 4, 2), vec![F(0), F(1), B(0), B(1)]);
        for stage in 0..4 {
            let order = schedule(Schedule::OneFOneB, stage, 4, 8);
            let mut alive: usize = 0;
            let mut most = 0;
            for w in &order {
                match w {
                    F(_) => alive += 1,
                    B(_) => alive -= 1,
                }
                most = most.max(alive);
            }
            assert_eq!(most, 4 - stage, "stage {stage}");
            assert_eq!(order.len(), 16);
        }
        assert_eq!(schedule(Schedule::GPipe, 1, 2, 2), vec![F(0), F(1), B(0), B(1)]);
    }
}
