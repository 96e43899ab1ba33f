//! How the job's ranks are laid out beside data parallelism: the tensor-parallel, pipeline and
//! data-parallel groups (`split_groups`), a pipeline stage's units (`pipeline_stage`), and this
//! rank's place among them.

use super::{pipeline, tensor, DataParallel, Schedule};
use crate::dist::compress::Compression;
use crate::trainer::Trainer;
use crate::TrainError;

impl DataParallel {
    /// Cuts the job into model copies of `pipeline` stages, each stage's model cut over `tensor`
    /// consecutive ranks (rank = (copy x pipeline + stage) x tensor + part), and the groups
    /// between them: tensor-parallel (one stage's parts), pipeline (one copy's stages of one
    /// part), data-parallel (one stage's part across the copies). Nothing for 1 and 1. Call once,
    /// right after joining, on every rank. ZeRO runs within the data-parallel groups of either (not
    /// of both at once): stage 1 beside stages, any stage beside a cut model; compressed
    /// reductions are not composed with them yet.
    pub fn split_groups(&mut self, tensor: usize, pipeline: usize) -> Result<(), TrainError> {
        for (key, ways) in [("dist.tensor", tensor), ("dist.pipeline", pipeline)] {
            if ways <= 1 {
                continue;
            }
            let refuse = |what_key: &'static str, what: &str| TrainError::InvalidConfig {
                key: what_key,
                message: format!("is {what}, which {key} = {ways} does not run with yet"),
            };
            // Pipeline stages shard their optimizer state over their copies (ZeRO-1); the copies
            // of a cut model's parts shard at any stage; not both at once.
            let zero_runs = match key {
                "dist.pipeline" => tensor <= 1 && self.config.zero.stage <= 1,
                _ => pipeline <= 1,
            };
            if key == "dist.pipeline" && tensor <= 1 && self.config.zero.stage >= 2 {
                // A stage's gradients build up over every micro-batch's backward until the step's
                // last: sharding them would reduce each micro-batch's (m times the traffic) to save
                // one stage's gradient buffer, which DeepSpeed's pipeline engine refuses too.
                return Err(TrainError::InvalidConfig {
                    key: "dist.zero",
                    message: format!(
                        "is {}, which {key} = {ways} does not run with: a stage's gradients build up over the step's \
                         micro-batches, so sharding them would reduce every micro-batch's; dist.zero = 1 shards the \
                         optimizer state and reduce-scatters the gradients once a step",
                        self.config.zero.stage
                    ),
                });
            }
            if self.config.zero.stage > 0 && !zero_runs {
                return Err(refuse("dist.zero", &self.config.zero.stage.to_string()));
            }
            if self.config.compress.compression != Compression::None {
                return Err(refuse("dist.compress", "set"));
            }
        }
        let (tensor, pipeline) = (tensor.max(1), pipeline.max(1));
        if tensor > 1 {
            self.tensor = Some(tensor::split_groups(self.comm.as_ref(), tensor, pipeline)?);
        }
        if pipeline > 1 {
            let mut parts = pipeline::split_groups(self.comm.as_ref(), pipeline, tensor)?;
            parts.zero = self.config.zero.stage == 1 && parts.data.is_some();
            self.pipeline = Some(parts);
        }
        Ok(())
    }

    /// This rank's stage: cuts `trainer`'s model into the stages' chunks (balanced by each unit's
    /// FLOPs, or `split` units per chunk), gives its optimizer this stage's units alone, and
    /// returns its chunks' units. None without pipeline stages. Call
    /// after any restore, on every rank.
    pub fn pipeline_stage(
        &mut self,
        trainer: &mut Trainer,
        schedule: Schedule,
        split: &[usize],
    ) -> Result<Option<Vec<std::ops::Range<usize>>>, TrainError> {
        let Some(parts) = self.pipeline.as_mut() else { return Ok(None) };
        let link = parts.plan(trainer.model(), schedule, split)?;
        let units = link.chunks.clone();
        let fused = trainer.fused_cpu_optimizer();
        let starts = parts.shard(trainer.params_mut(), fused).map_err(|e| TrainError::InvalidConfig {
            key: "dist.pipeline",
            message: format!("cannot map memory for a stage's buffers: {e}"),
        })?;
        trainer
            .shard_optimizer(parts.shard.as_ref().expect("shard made"), &starts)
            .map_err(|message| TrainError::InvalidConfig { key: "dist.pipeline", message })?;
        trainer.set_stage(link)?;
        self.grad_buffer = Some(trainer.model().params().flat_grad().shallow_clone());
        Ok(Some(units))
    }

    /// Every chunk's units, stage by stage in the model's order (empty without pipeline stages).
    pub fn stage_units(&self) -> Vec<std::ops::Range<usize>> {
        self.pipeline.as_ref().map_or_else(Vec::new, |p| p.stage_units().to_vec())
    }

    /// (this rank's stage, the stages) of its model copy; (0, 1) without pipeline stages.
    pub fn stage(&self) -> (usize, usize) {
        self.pipeline.as_ref().map_or((0, 1), |p| (p.stage, p.stages))
    }

    /// The group this rank's model is cut over (`split_groups`), for `Trainer::split_tensor`.
    pub fn tensor_group(&self) -> Option<std::sync::Arc<crate::models::TensorGroup>> {
        self.tensor.as_ref().map(|t| t.group.clone())
    }

    /// What moves the bytes of a cut model's groups, "tensor over shm, data over tcp": with the
    /// `tcp` backend a group inside one node runs over shared memory. None for an uncut model.
    pub fn tensor_transports(&self) -> Option<String> {
        let parts = self.tensor.as_ref()?;
        let mut text = format!("tensor over {}", parts.group.communicator().backend());
        if let Some(data) = &parts.data {
            text.push_str(&format!(", data over {}", data.backend()));
        }
        Some(text)
    }

    /// After `Trainer::split_tensor`: keeps what the whole model's gradient norm needs.
    pub fn track_cut_model(&mut self, trainer: &Trainer) {
        if let Some(parts) = self.tensor.as_mut() {
            parts.track(trainer.model());
        }
    }

    /// This rank's place among the model copies that read different rows: (its index, their
    /// number). The job's rank and size unless the model is cut.
    pub fn data_rank(&self) -> (usize, usize) {
        if let Some(parts) = &self.pipeline {
            return (parts.copy, self.comm.world_size() / (parts.stages * parts.tensor));
        }
        match &self.tensor {
            Some(parts) => {
                let group = parts.group.size();
                (self.comm.rank() / group, self.comm.world_size() / group)
            }
            None => (self.comm.rank(), self.comm.world_size()),
        }
    }
}
