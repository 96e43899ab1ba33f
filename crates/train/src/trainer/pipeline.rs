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
        let start = std::time::Instant::now();
        let result = self.transfer(out, inbound);
        self.waited += start.elapsed();
        result
    }

    /// `exchange` without its timing.
    fn transfer(
        &mut self,
        out: Option<(usize, &Tensor, usize)>,
        inbound: Option<(usize, usize)>,
    ) -> Result<Option<Tensor>, TrainError> {
        let stage = self.link.stage;
        let op = match (out, inbound) {
            (Some(_), Some(_)) => "send to and receive from the neighbour stages",
            (Some((peer, ..)), None) if peer > stage => "send activations to the next stage",
            (Some(_), None) => "send gradients to the previous stage",
            (None, Some((peer, _))) if peer < stage => "receive activations from the previous stage",
            (None, _) => "receive gradients from the next stage",
        };
        let outbound = match out {
            Some((peer, tensor, micro)) => {
                let host = tensor.to_device(Device::Cpu).contiguous();
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
                header[6] = micro as u64;
                header[7] = host.numel() as u64;
                if peer > stage {
                    self.gradients = Some((host.kind(), size));
                }
                let bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
                Some((peer, bytes, host))
            }
            None => None,
        };
        let mut header_in = [0u8; 8 * HEADER];
        let mut header_read = false;
        let expected = match inbound {
            Some((peer, micro)) => {
                let known = if peer < stage { &self.activations } else { &self.gradients };
                Some(match known.clone() {
                    Some(layout) => layout,
                    // The run's first activations: a stage's first transfer, a receive alone, so
                    // its header can be read first to size the payload.
                    None if outbound.is_none() && peer < stage => {
                        stoke_comm::CommunicatorExt::recv(self.comm(), &mut header_in, peer).map_err(self.error(op))?;
                        header_read = true;
                        let layout = self.check_header(&header_in, peer, micro, None)?;
                        self.activations = Some(layout.clone());
                        layout
                    }
                    None => {
                        return Err(invalid(format!(
                            "stage {stage} would receive from stage {peer} before it knows the message's size"
                        )))
                    }
                })
            }
            None => None,
        };
        let mut ops = Vec::with_capacity(4);
        if let Some((peer, bytes, host)) = &outbound {
            ops.push(P2p::Send { region: Region::new(bytes.as_ptr() as *mut u8, bytes.len(), DType::U8), peer: *peer });
            let payload = host.numel() * host.kind().elt_size_in_bytes();
            ops.push(P2p::Send { region: Region::new(host.data_ptr() as *mut u8, payload, DType::U8), peer: *peer });
        }
        let mut received = None;
        if let (Some((peer, _)), Some((kind, dims))) = (inbound, &expected) {
            if !header_read {
                ops.push(P2p::Recv { region: Region::of(&mut header_in[..]), peer });
            }
            let host = Tensor::empty(dims.as_slice(), (*kind, Device::Cpu));
            let payload = host.numel() * kind.elt_size_in_bytes();
            ops.push(P2p::Recv { region: Region::new(host.data_ptr() as *mut u8, payload, DType::U8), peer });
            received = Some(host);
        }
        // SAFETY: every region (the headers, `outbound`'s host tensor, the fresh receive tensor)
        // lives until `wait` returns; the receives overlap nothing else.
        unsafe { self.comm().p2p_batch_async(&ops) }.and_then(|w| w.wait()).map_err(self.error(op))?;
        if let (Some((peer, micro)), Some(layout), false) = (inbound, &expected, header_read) {
            self.check_header(&header_in, peer, micro, Some(layout))?;
        }
        Ok(received.map(|host| host.to_device(self.device)))
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

    /// The layout a received header announces, checked against the micro-batch and the layout
    /// expected (a neighbour that changed shape, or a schedule out of step, is an error naming it).
    fn check_header(
        &self,
        bytes: &[u8; 8 * HEADER],
        peer: usize,
        micro: usize,
        expected: Option<&Layout>,
    ) -> Result<Layout, TrainError> {
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
        if header[6] as usize != micro || !consistent || !as_expected {
            return Err(invalid(format!(
                "stage {} expected micro-batch {micro}{} from stage {peer}, got micro-batch {} of shape {dims:?} ({} elements, {kind:?})",
                self.link.stage,
                expected.map(|(k, d)| format!(" of shape {d:?} ({k:?})")).unwrap_or_default(),
                header[6],
                header[7]
            )));
        }
        Ok((kind, dims))
    }
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
        let n_micro = self.grad_accum;
        let loss_multiplier = self.scaler.as_ref().map_or(1.0, crate::precision::LossScaler::scale) / n_micro as f64;
        let (first, last_stage) = (link.stage == 0, link.stage + 1 == link.stages);
        let mut loss_sum = Tensor::zeros([], (Kind::Float, self.device));
        let mut memory = None;
        let mut net =
            Link { link, device: self.device, activations: None, gradients: None, waited: std::time::Duration::ZERO };
        let span = std::time::Instant::now();
        // Micro-batches between their forward and backward: their inputs and kept activations.
        let mut pending: std::collections::VecDeque<(usize, Inputs, Forwarded)> = std::collections::VecDeque::new();
        self.model.begin_step_casts(false);
        let model = self.model.as_ref();
        // What a send brought back ahead of its use: (micro-batch, tensor).
        let mut ahead: Option<(usize, Tensor)> = None;
        let order = schedule(link.schedule, link.stage, link.stages, n_micro);
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
                    let inputs = self.next_inputs(source, step_number, clock)?;
                    let input = if first {
                        StageInput::Batch
                    } else {
                        let received = net.take_or_receive(&mut ahead, link.stage - 1, micro)?;
                        clock.lap(Phase::CommExposed);
                        StageInput::Received(received)
                    };
                    let measure = measure_memory && micro == 0;
                    let before = measure.then(crate::peak::host_bytes_in_use).flatten();
                    let forwarded = self.executor.forward_units(
                        model,
                        link.units.clone(),
                        input,
                        &inputs,
                        loss_multiplier,
                        measure,
                        clock,
                        hooks,
                    )?;
                    if let (Some(before), Some(per_block), Some(peak)) =
                        (before, forwarded.activation_bytes.clone(), forwarded.peak_bytes_in_use)
                    {
                        memory = Some(self.memory_report(before, per_block, peak));
                    }
                    if let Some(output) = &forwarded.output {
                        let with = next_receive.filter(|(peer, _)| *peer > link.stage);
                        let got = net.exchange(Some((link.stage + 1, output, micro)), with)?;
                        ahead = got.zip(with).map(|(tensor, (_, j))| (j, tensor));
                        clock.lap(Phase::CommExposed);
                    }
                    pending.push_back((micro, inputs, forwarded));
                }
                Work::Backward(micro) => {
                    let (held, _inputs, forwarded) = pending.pop_front().expect("a backward follows its forward");
                    debug_assert_eq!(held, micro, "micro-batches leave a stage in the order they came");
                    let grad_output = if last_stage {
                        None
                    } else {
                        let grad = net.take_or_receive(&mut ahead, link.stage + 1, micro)?;
                        clock.lap(Phase::CommExposed);
                        Some(grad)
                    };
                    let last = micro + 1 == n_micro;
                    let backward = self.executor.backward_units(model, forwarded, grad_output, last, clock, hooks)?;
                    if let Some(loss) = backward.loss {
                        loss_sum += loss / n_micro as f64;
                    }
                    if let Some(grad) = &backward.grad_input {
                        let with = next_receive.filter(|(peer, _)| *peer < link.stage);
                        let got = net.exchange(Some((link.stage - 1, grad, micro)), with)?;
                        ahead = got.zip(with).map(|(tensor, (_, k))| (k, tensor));
                        clock.lap(Phase::CommExposed);
                    }
                }
            }
        }
        self.stage_times = Some((net.waited.as_secs_f64() * 1e3, span.elapsed().as_secs_f64() * 1e3));
        drop(pending);
        self.model.end_step_casts();
        Ok((loss_sum, memory, None))
    }
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
