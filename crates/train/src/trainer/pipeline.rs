//! One step of a pipeline stage (`dist.pipeline`): the step's micro-batches through this stage's
//! units in the schedule's order, activations received from the previous stage and sent to the
//! next, their gradients back.
//!
//! Every stage reads the same micro-batches from its own source (the first stage needs the
//! tokens, the last the targets), so the sources stay at one position. Sends and receives are
//! blocking and run in the schedule's order. Under 1F1B two neighbours may both want to send to
//! each other (the forward's output one way, the backward's input gradient the other); an odd
//! stage then receives first and sends after, an even one sends first (Megatron-LM's order
//! without batched send/receive), so the pair always meets. Waiting on a neighbour is charged to
//! `comm_exposed`: a stage's share of it is the bubble plus the transfers.

use stoke_comm::{Communicator, Region};
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

/// A stage's link to its neighbours, with the sends an odd stage holds back (see the module doc).
struct Link<'a> {
    link: &'a StageLink,
    device: Device,
    /// A send held back until the receive from the same peer: (peer, header, host tensor).
    held: Option<(usize, [u64; HEADER], Tensor)>,
    /// Time spent blocked sending and receiving.
    waited: std::time::Duration,
}

impl<'a> Link<'a> {
    fn comm(&self) -> &dyn Communicator {
        self.link.comm.as_ref()
    }

    fn error(&self, op: &'static str, source: stoke_comm::CommError) -> TrainError {
        TrainError::Comm { rank: self.comm().rank(), world_size: self.comm().world_size(), op, source }
    }

    fn send_now(&mut self, peer: usize, header: &[u64; HEADER], host: &Tensor) -> Result<(), TrainError> {
        let start = std::time::Instant::now();
        let result = self.send_blocking(peer, header, host);
        self.waited += start.elapsed();
        result
    }

    fn send_blocking(&self, peer: usize, header: &[u64; HEADER], host: &Tensor) -> Result<(), TrainError> {
        let op = if peer > self.link.stage {
            "send activations to the next stage"
        } else {
            "send gradients to the previous stage"
        };
        let bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
        let region = Region::new(
            host.data_ptr() as *mut u8,
            header[7] as usize * host.kind().elt_size_in_bytes(),
            stoke_comm::DType::U8,
        );
        stoke_comm::CommunicatorExt::send(self.comm(), &bytes, peer).map_err(|e| self.error(op, e))?;
        // SAFETY: `host` is a contiguous CPU tensor alive until `wait` returns; a send only reads it.
        unsafe { self.comm().send_async(region, peer) }.and_then(|w| w.wait()).map_err(|e| self.error(op, e))
    }

    /// Sends `tensor` (micro-batch `micro`) to `peer`: now, or, on an odd stage under 1F1B,
    /// at the next receive from the same peer.
    fn send(&mut self, peer: usize, tensor: &Tensor, micro: usize) -> Result<(), TrainError> {
        self.flush()?;
        let host = tensor.to_device(Device::Cpu).contiguous();
        let size = host.size();
        let invalid = |message: String| TrainError::InvalidConfig { key: "dist.pipeline", message };
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
        if self.link.schedule == Schedule::OneFOneB && self.link.stage % 2 == 1 {
            self.held = Some((peer, header, host));
            return Ok(());
        }
        self.send_now(peer, &header, &host)
    }

    /// Sends what was held back.
    fn flush(&mut self) -> Result<(), TrainError> {
        match self.held.take() {
            Some((peer, header, host)) => self.send_now(peer, &header, &host),
            None => Ok(()),
        }
    }

    /// Receives micro-batch `micro`'s tensor from `peer`, on this stage's device.
    fn recv(&mut self, peer: usize, micro: usize) -> Result<Tensor, TrainError> {
        // A send held back for this peer goes after the receive; one for the other goes first.
        let held_for_peer = self.held.as_ref().is_some_and(|(to, _, _)| *to == peer);
        if !held_for_peer {
            self.flush()?;
        }
        let op = if peer < self.link.stage {
            "receive activations from the previous stage"
        } else {
            "receive gradients from the next stage"
        };
        let mut bytes = [0u8; 8 * HEADER];
        let start = std::time::Instant::now();
        stoke_comm::CommunicatorExt::recv(self.comm(), &mut bytes, peer).map_err(|e| self.error(op, e))?;
        let header: Vec<u64> =
            bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let kind = match header[0] {
            0 => Kind::Float,
            1 => Kind::BFloat16,
            2 => Kind::Half,
            code => {
                return Err(TrainError::InvalidConfig {
                    key: "dist.pipeline",
                    message: format!("stage {peer} sent an activation of unknown kind {code}"),
                })
            }
        };
        let ndim = (header[1] as usize).min(4);
        let dims: Vec<i64> = header[2..2 + ndim].iter().map(|&d| d as i64).collect();
        if header[6] as usize != micro || dims.iter().product::<i64>() as u64 != header[7] {
            return Err(TrainError::InvalidConfig {
                key: "dist.pipeline",
                message: format!(
                    "stage {} expected micro-batch {micro} from stage {peer}, got micro-batch {} of shape {dims:?} ({} elements)",
                    self.link.stage, header[6], header[7]
                ),
            });
        }
        let host = Tensor::empty(dims.as_slice(), (kind, Device::Cpu));
        let region = Region::new(
            host.data_ptr() as *mut u8,
            header[7] as usize * kind.elt_size_in_bytes(),
            stoke_comm::DType::U8,
        );
        // SAFETY: `host` is a fresh contiguous tensor of exactly those bytes, alive until `wait`.
        unsafe { self.comm().recv_async(region, peer) }.and_then(|w| w.wait()).map_err(|e| self.error(op, e))?;
        self.waited += start.elapsed();
        if held_for_peer {
            self.flush()?;
        }
        Ok(host.to_device(self.device))
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
        let mut net = Link { link, device: self.device, held: None, waited: std::time::Duration::ZERO };
        let span = std::time::Instant::now();
        // Micro-batches between their forward and backward: their inputs and kept activations.
        let mut pending: std::collections::VecDeque<(usize, Inputs, Forwarded)> = std::collections::VecDeque::new();
        self.model.begin_step_casts(false);
        let model = self.model.as_ref();
        for work in schedule(link.schedule, link.stage, link.stages, n_micro) {
            match work {
                Work::Forward(micro) => {
                    let inputs = self.next_inputs(source, step_number, clock)?;
                    let input = if first {
                        StageInput::Batch
                    } else {
                        let received = net.recv(link.stage - 1, micro)?;
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
                        net.send(link.stage + 1, output, micro)?;
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
                        let grad = net.recv(link.stage + 1, micro)?;
                        clock.lap(Phase::CommExposed);
                        Some(grad)
                    };
                    let last = micro + 1 == n_micro;
                    let backward = self.executor.backward_units(model, forwarded, grad_output, last, clock, hooks)?;
                    if let Some(loss) = backward.loss {
                        loss_sum += loss / n_micro as f64;
                    }
                    if let Some(grad) = &backward.grad_input {
                        net.send(link.stage - 1, grad, micro)?;
                        clock.lap(Phase::CommExposed);
                    }
                }
            }
        }
        net.flush()?;
        clock.lap(Phase::CommExposed);
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
