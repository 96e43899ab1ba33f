//! A checkpoint of the trainer: the snapshot a step hands to the writer, and the restore that
//! loads one back with shape checks.

use stoke_ckpt::{CheckpointStore, CheckpointWriter, DType, Loaded, Snapshot, TensorRecord};
use tch::{Device, Kind, Tensor};

use crate::executor::Gathered;
use crate::optimizers::state_views;
use crate::params::{FlatParams, ParamEntry};
use crate::snapcopy::PendingCopy;
use crate::TrainError;

use super::state::Trainer;
use crate::models::Model;

/// A checkpoint tensor: its file's stem, its name, its shape, its values.
pub(super) type WholeTensor = (&'static str, String, Vec<i64>, Tensor);

/// A checkpoint's tensor as a cut model holds it: this rank's part of a whole `values` of
/// parameter `param` (itself when the model is not cut or the tensor is not split).
fn cut_for_this_rank(model: &dyn Model, param: &str, values: Tensor) -> Tensor {
    match model.tensor_group() {
        Some(group) => model.split_of(param).cut(&values, group.rank(), group.size()),
        None => values,
    }
}

/// Where checkpoints go and what the caller wants stored with each (for example the resolved
/// config). The writer decides how (in the background or not, host buffers, retention).
pub struct CheckpointTarget {
    pub writer: CheckpointWriter,
    pub meta: serde_json::Value,
}

/// Names the optimizer in a checkpoint's meta.
pub(super) fn object_optimizer(meta: &mut serde_json::Value, name: &str) {
    if let Some(object) = meta.as_object_mut() {
        object.insert("optimizer".into(), serde_json::json!(name));
    }
}

/// Finishes the checkpoint copy started beside this step, if any, and hands its snapshot to the
/// writer.
pub(super) fn submit_pending(
    pending: &mut Option<PendingCopy>,
    target: Option<&mut CheckpointTarget>,
    threads: usize,
) -> Result<(), TrainError> {
    let Some(copy) = pending.take() else { return Ok(()) };
    let target = target.expect("a pending checkpoint copy has its writer");
    let best_eval = copy.best_eval;
    submit(&mut target.writer, copy.finish(threads), best_eval)
}

/// Hands a filled snapshot to the writer; the best evaluation's checkpoint is kept from retention.
pub(super) fn submit(writer: &mut CheckpointWriter, snapshot: Snapshot, best_eval: bool) -> Result<(), TrainError> {
    let step = snapshot.step();
    writer.submit(snapshot)?;
    if best_eval {
        writer.protect(Some(step));
    }
    Ok(())
}

/// Copies `t` into `dst`. A contiguous CPU tensor is copied by
/// `stoke_ckpt::stream_copy_checksummed` (the intra-op thread count, streaming stores: about twice
/// libtorch's copy into a large host buffer), which also hashes it from the cache: the returned
/// (address, bytes, CRC-32) is for `Snapshot::add_checksums`. Anything else (another device, a
/// strided view) is copied by libtorch, and the writer hashes it. `STOKE_CKPT_COPY=torch` uses
/// libtorch's copy for every tensor (a diagnostic switch).
pub(super) fn copy_into(t: &Tensor, dst: &mut [u8]) -> Option<(usize, usize, u32)> {
    let numel = t.numel();
    assert_eq!(dst.len(), numel * t.kind().elt_size_in_bytes(), "the host slot fits the tensor");
    if !dst.is_empty()
        && t.device() == Device::Cpu
        && t.is_contiguous()
        && std::env::var_os("STOKE_CKPT_COPY").is_none_or(|v| v != "torch")
    {
        let threads = tch::get_num_threads().max(1) as usize;
        // SAFETY: a contiguous CPU tensor's `dst.len()` bytes (numel x element size, checked
        // above) start at `data_ptr`; `t` is borrowed for this whole function, so the storage
        // stays alive, and nothing writes it meanwhile (the step is not running).
        let src = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, dst.len()) };
        return Some((dst.as_ptr() as usize, dst.len(), stoke_ckpt::stream_copy_checksummed(dst, src, threads)));
    }
    // SAFETY: `host` views exactly `dst`'s bytes (length checked above) as a CPU tensor; `dst` is
    // borrowed mutably for this whole function and `host` is dropped before it returns, so
    // nothing else reads or writes that memory meanwhile and the view never outlives it.
    let mut host = unsafe { Tensor::from_blob(dst.as_mut_ptr(), &[numel as i64], &[1], t.kind(), Device::Cpu) };
    tch::no_grad(|| host.copy_(&t.reshape([-1])));
    None
}

impl Trainer {
    /// Restores model, optimizer, loss scaler and step from a checkpoint; returns the data
    /// position to seek to.
    pub fn restore(&mut self, store: &CheckpointStore, step: u64) -> Result<u64, TrainError> {
        self.restore_loaded(&store.load(step)?)
    }

    /// `restore` from a checkpoint already loaded (and verified) by the caller.
    pub fn restore_loaded(&mut self, loaded: &Loaded) -> Result<u64, TrainError> {
        let mismatch = |message: String| TrainError::CheckpointMismatch { path: loaded.path.clone(), message };
        let model_file = loaded.files.get("model").ok_or_else(|| mismatch("no model.safetensors".into()))?;
        let optim_file = loaded.files.get("optim").ok_or_else(|| mismatch("no optim.safetensors".into()))?;
        let params = self.model.params();
        if model_file.len() != params.entries().len() {
            return Err(mismatch(format!(
                "{} tensors, this model has {} (is model.* the same as the run's?)",
                model_file.len(),
                params.entries().len()
            )));
        }
        let meta = &loaded.manifest.meta;
        let number = |key: &str| {
            meta.get(key)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| mismatch(format!("manifest meta has no {key}")))
        };
        let optimizer_steps = number("optimizer_steps")?;
        let data_position = number("data_position")?;
        let device = self.device;
        let f32_tensor = |record: &TensorRecord| -> Result<(Vec<i64>, Tensor), TrainError> {
            let shape: Vec<i64> = record.shape.iter().map(|&s| s as i64).collect();
            if record.dtype != DType::F32 {
                return Err(mismatch(format!("tensor {:?} is {:?}, want F32", record.name, record.dtype)));
            }
            Ok((shape.clone(), Tensor::from_data_size(&record.data, &shape, Kind::Float).to_device(device)))
        };
        tch::no_grad(|| -> Result<(), TrainError> {
            for entry in params.entries() {
                let record = model_file
                    .iter()
                    .find(|r| r.name == entry.name)
                    .ok_or_else(|| mismatch(format!("no tensor {:?}", entry.name)))?;
                let (_, values) = f32_tensor(record)?;
                // A whole tensor into a cut model: this rank's part.
                let values = cut_for_this_rank(self.model.as_ref(), &entry.name, values);
                let shape = values.size();
                if shape != entry.shape {
                    return Err(mismatch(format!(
                        "tensor {:?} has shape {shape:?}, the model wants {:?}",
                        entry.name, entry.shape
                    )));
                }
                params.flat().narrow(0, entry.offset, entry.numel).copy_(&values.view([-1]));
            }
            Ok(())
        })?;
        let mut bad_record = None;
        let model = self.model.as_ref();
        self.optimizer
            .load_state(params, optimizer_steps, |name| {
                let record = optim_file.iter().find(|r| r.name == name)?;
                match f32_tensor(record) {
                    Ok((_, values)) => {
                        let param = name.rsplit_once('.').map_or(name, |(param, _)| param);
                        let values = cut_for_this_rank(model, param, values);
                        Some((values.size(), values))
                    }
                    Err(err) => {
                        bad_record = Some(err);
                        None
                    }
                }
            })
            .map_err(|message| bad_record.take().unwrap_or_else(|| mismatch(message)))?;
        if let Some(scaler) = &mut self.scaler {
            let scale = meta.get("loss_scale").and_then(serde_json::Value::as_f64);
            match (scale, number("loss_scale_clean_steps"), number("skipped_steps")) {
                (Some(scale), Ok(clean), Ok(skipped)) => scaler.restore(scale, clean, skipped),
                _ => return Err(mismatch("an fp16 run needs the loss scaler's state in the manifest".into())),
            }
        }
        if let Some(accum) = meta.get("grad_accum").and_then(serde_json::Value::as_u64) {
            self.grad_accum = accum as usize;
        }
        if let Some(adaptive) = &mut self.adaptive {
            adaptive.noise.g2 = meta.get("gns_g2").and_then(serde_json::Value::as_f64);
            adaptive.noise.trace = meta.get("gns_trace").and_then(serde_json::Value::as_f64);
        }
        if let Some(eval) = &mut self.eval {
            eval.best = meta.get("eval_best_loss").and_then(serde_json::Value::as_f64).unwrap_or(f64::INFINITY);
            eval.best_step = meta.get("eval_best_step").and_then(serde_json::Value::as_u64);
            eval.stale = meta.get("eval_stale").and_then(serde_json::Value::as_u64).unwrap_or(0);
        }
        self.step = loaded.manifest.step;
        self.resumed_from = Some(loaded.path.clone());
        Ok(data_position)
    }

    /// A cut model's state made whole for a checkpoint, as one process's would be: every split
    /// parameter and its optimizer state gathered over the tensor-parallel group, so any layout
    /// resumes from it. Collective: every rank of the group calls it at the same checkpoints.
    /// None for a model that is not cut. `shard`: the buffers a sharded optimizer runs on (a
    /// pipeline stage's units, whole parameters flattened); then only those are gathered.
    /// `gathered`: the optimizer's state buffers in the model's layout, already gathered over the
    /// copies that shard it (ZeRO beside the cut), and the parameters when the model's own are
    /// given back (stage 3); then every parameter is gathered.
    pub(super) fn whole_state(
        &self,
        shard: Option<&FlatParams>,
        gathered: Option<Gathered>,
    ) -> Result<Option<Vec<WholeTensor>>, TrainError> {
        let Some(group) = self.model.tensor_group() else { return Ok(None) };
        let params = self.model.params();
        let shard = shard.filter(|_| self.sharded && gathered.is_none());
        let owned: Option<std::collections::HashSet<&str>> =
            shard.map(|s| s.entries().iter().map(|e| e.name.as_str()).collect());
        let shapes: std::collections::HashMap<&str, &[i64]> =
            params.entries().iter().map(|e| (e.name.as_str(), e.shape.as_slice())).collect();
        let (gathered_params, gathered) = match gathered {
            Some((params, buffers)) => (params, Some(buffers)),
            None => (None, None),
        };
        let value = |e: &ParamEntry| match &gathered_params {
            Some(flat) => flat.narrow(0, e.offset, e.numel).view(e.shape.as_slice()),
            None => e.tensor.detach(),
        };
        let model = params
            .entries()
            .iter()
            .filter(|e| owned.as_ref().is_none_or(|o| o.contains(e.name.as_str())))
            .map(|e| ("model", e.name.clone(), e.name.clone(), value(e)));
        let states = match gathered {
            Some(buffers) => {
                let buffers: Vec<(&str, &Tensor)> = buffers.iter().map(|(suffix, t)| (*suffix, t)).collect();
                state_views(params, &buffers)
            }
            None => self.optimizer.state_tensors(shard.unwrap_or(params)),
        };
        let optim = states.into_iter().map(|s| {
            let param = s.name.rsplit_once('.').map_or(s.name.as_str(), |(param, _)| param).to_string();
            // A stage's state is flat, one piece per whole parameter: shaped like it again.
            let tensor = match shapes.get(param.as_str()) {
                Some(shape) if s.tensor.numel() as i64 == shape.iter().product::<i64>() => s.tensor.reshape(*shape),
                _ => s.tensor,
            };
            ("optim", s.name, param, tensor)
        });
        let gathered = model.chain(optim).map(|(stem, name, param, tensor)| {
            let whole =
                group.gather_whole(self.model.split_of(&param), &tensor).map_err(|source| TrainError::Comm {
                    rank: group.rank(),
                    world_size: group.size(),
                    op: "gather a cut model's checkpoint",
                    source,
                })?;
            Ok((stem, name, whole.size(), whole))
        });
        gathered.collect::<Result<Vec<_>, TrainError>>().map(Some)
    }

    /// Copies the state into a host buffer: the part of a checkpoint the step must wait for.
    /// `shard`: the ZeRO shard this rank's optimizer runs on; then the snapshot holds this rank's
    /// pieces of every parameter and optimizer tensor (`Snapshot::piece`, a sharded writer), which
    /// rank 0's checkpoint lists beside the other ranks' (no gathering).
    ///
    /// `defer` (an unsharded snapshot only): when every tensor can be (`snapcopy::can_defer`), their rooms are taken but not
    /// filled, and the tensors are returned for a `PendingCopy`; otherwise they are copied now and
    /// nothing is returned.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn snapshot_into(
        &self,
        snapshot: &mut Snapshot,
        extra: &serde_json::Value,
        data_position: u64,
        shard: Option<&FlatParams>,
        defer: bool,
        whole: Option<Vec<WholeTensor>>,
    ) -> Vec<(String, String, Tensor)> {
        let mut deferred = Vec::new();
        let params = self.model.params();
        let shape_of = |shape: &[i64]| -> Vec<usize> { shape.iter().map(|&s| s as usize).collect() };
        match (shard, whole) {
            // A cut pipeline stage: its units' tensors gathered whole, each one piece.
            (Some(shard), Some(whole)) => {
                let mine: std::collections::HashSet<&str> = shard.entries().iter().map(|e| e.name.as_str()).collect();
                for (stem, name, shape, tensor) in whole {
                    let param =
                        if stem == "optim" { name.rsplit_once('.').map_or(name.as_str(), |(p, _)| p) } else { &name };
                    if !mine.contains(param) {
                        continue;
                    }
                    let shape = shape_of(&shape);
                    let numel = shape.iter().product::<usize>();
                    let room = snapshot.piece(stem, &name, DType::F32, &shape, 0..numel);
                    let checksum = copy_into(&tensor, room);
                    snapshot.add_checksums(checksum);
                }
            }
            (Some(shard), None) => {
                // Each shard entry is this rank's piece of the parameter of that name: elements
                // from `source - offset` of it (a unit's slice is contiguous, so one per parameter).
                let whole: std::collections::HashMap<&str, (i64, Vec<usize>)> =
                    params.entries().iter().map(|e| (e.name.as_str(), (e.offset, shape_of(&e.shape)))).collect();
                let mut pieces = std::collections::HashMap::new();
                for entry in shard.entries() {
                    let (offset, shape) = &whole[entry.name.as_str()];
                    let start = (entry.source - offset) as usize;
                    let range = start..start + entry.numel as usize;
                    let room = snapshot.piece("model", &entry.name, DType::F32, shape, range.clone());
                    let checksum = copy_into(&entry.tensor.detach(), room);
                    snapshot.add_checksums(checksum);
                    pieces.insert(entry.name.as_str(), (range, shape));
                }
                for state in self.optimizer.state_tensors(shard) {
                    let param = state.name.rsplit_once('.').map_or(state.name.as_str(), |(param, _)| param);
                    let (range, shape) = &pieces[param];
                    let room = snapshot.piece("optim", &state.name, DType::F32, shape, range.clone());
                    let checksum = copy_into(&state.tensor, room);
                    snapshot.add_checksums(checksum);
                }
            }
            (None, whole) => {
                let sources: Vec<(&str, String, Vec<i64>, Tensor)> = params
                    .entries()
                    .iter()
                    .map(|e| ("model", e.name.clone(), e.shape.clone(), e.tensor.detach()))
                    .chain(
                        self.optimizer.state_tensors(params).into_iter().map(|s| ("optim", s.name, s.shape, s.tensor)),
                    )
                    .collect();
                // A cut model's tensors gathered whole (fresh tensors: nothing to defer for).
                let (sources, defer) = match whole {
                    Some(whole) => (whole, false),
                    None => (sources, defer),
                };
                let defer = defer && sources.iter().all(|(_, _, _, t)| crate::snapcopy::can_defer(t));
                if defer {
                    // The first snapshots into a buffer fault its pages in: the copy beside the step does.
                    snapshot.fault_in_when_filled();
                }
                for (stem, name, shape, tensor) in sources {
                    let room = snapshot.tensor(stem, &name, DType::F32, &shape_of(&shape));
                    if defer {
                        deferred.push((stem.to_string(), name, tensor));
                    } else {
                        let checksum = copy_into(&tensor, room);
                        snapshot.add_checksums(checksum);
                    }
                }
            }
        }
        let mut meta = serde_json::json!({
            "step": self.step,
            "optimizer_steps": self.optimizer.n_steps(),
            "data_position": data_position,
            "seed": self.train.seed,
        });
        if let (Some(scaler), Some(object)) = (&self.scaler, meta.as_object_mut()) {
            let (scale, clean, skipped) = scaler.state();
            object.insert("loss_scale".into(), serde_json::json!(scale));
            object.insert("loss_scale_clean_steps".into(), serde_json::json!(clean));
            object.insert("skipped_steps".into(), serde_json::json!(skipped));
        }
        if let (Some(eval), Some(object)) = (&self.eval, meta.as_object_mut()) {
            if let Some(best_step) = eval.best_step {
                object.insert("eval_best_loss".into(), serde_json::json!(eval.best));
                object.insert("eval_best_step".into(), serde_json::json!(best_step));
            }
            object.insert("eval_stale".into(), serde_json::json!(eval.stale));
        }
        object_optimizer(&mut meta, self.train.optimizer.name());
        if let (Some(adaptive), Some(object)) = (&self.adaptive, meta.as_object_mut()) {
            object.insert("grad_accum".into(), serde_json::json!(self.grad_accum));
            object.insert("gns_g2".into(), serde_json::json!(adaptive.noise.g2));
            object.insert("gns_trace".into(), serde_json::json!(adaptive.noise.trace));
        }
        if let (Some(meta), Some(extra)) = (meta.as_object_mut(), extra.as_object()) {
            meta.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        snapshot.set_meta(meta);
        deferred
    }
}
