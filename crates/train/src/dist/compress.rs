//! Compressed gradient communication with error feedback: the average of an fp32 buffer over the
//! ranks, sent as bf16 or block-wise int8 instead of fp32.
//!
//! **Formats** ([`Compression`]). `Int8 { block }`: each block of `block` consecutive values is
//! one f32 scale (max |x| / 127) and one i8 per value (x / scale rounded to the nearest integer),
//! so a value costs 1 + 4 / block bytes and decodes with an error of at most scale / 2. `Bf16`:
//! 2 bytes per value, rounded to nearest even. `None`: the fp32 bytes themselves, through the same
//! two phases (the lossless reference of the path; a trainer's uncompressed steps use the
//! communicator's own collectives instead).
//!
//! **Reduce-scatter (average)**. The buffer is cut into `world_size` chunks by
//! [`stoke_comm::shard_range`] (the cut of `reduce_scatter_async`); each chunk is encoded for the
//! rank that owns it, the encoded chunks travel in one all-to-all of bytes (each padded to the
//! longest chunk's size, so the all-to-all's chunks are equal), and rank r decodes the n payloads
//! of its shard and sums them in rank order, then divides by n. Every rank computes its shard the
//! same way, so the result does not depend on timing.
//!
//! **All-reduce (average)** = that reduce-scatter, then each rank encodes its averaged shard again
//! and the payloads are all-gathered as bytes; every rank ends with every shard's decoded value,
//! its own included, so all ranks hold the same bits (a rank writes its own shard's decoded value
//! while encoding it, in the same pass that averages it, and decodes the other ranks' shards).
//!
//! **Kernels** (`codec`): a scalar definition and a vectorized version (AVX-512 or AVX2, picked at
//! run time) that gives the same bits, so results and residuals do not depend on the CPU.
//!
//! **Error feedback** (`error_feedback`, as in 1-bit Adam and ZeRO++). What the encoding lost this
//! step (the residual: value minus decoded value) is kept per reduced buffer, keyed by a
//! caller-chosen id (a unit or bucket index), and added to the next step's values before they are
//! encoded; so nothing is lost for good, only delayed, and the running sum of what was sent tracks
//! the running sum of the true values within one quantization step. The all-reduce's second
//! encoding keeps a residual of its own over the rank's shard (the "server side"). Residuals are
//! in the buffer's units (a loss-scaled gradient's residual is loss-scaled). A non-finite value
//! passes through as non-finite (its block decodes to NaN, so an overflow check still sees it) and
//! leaves a zero residual. [`Compressor::residual_state`] and
//! [`Compressor::load_residual_state`] save and restore them by name for checkpoints.
//!
//! **Overlap.** [`Compressor::start_reduce_scatter`] / [`Compressor::start_all_reduce`] encode and
//! submit the all-to-all and return a [`Pending`] that owns its byte buffers (the gradient buffer
//! is free again at once); [`Compressor::finish`] waits, decodes and sums, and for an all-reduce
//! runs the second phase. [`Compressor::wire_bytes`] counts the bytes this rank sent to other
//! ranks. Everything here runs on host memory, on the calling thread.

mod codec;

use std::collections::BTreeMap;

use stoke_comm::{shard_range, CommError, Communicator, CommunicatorExt, Region, Work};

use crate::TrainError;
pub use codec::Compression;

use codec::{Isa, Reencode};

/// Name prefix of the first phase's residuals (over the whole buffer) in checkpoints.
const RESIDUAL: &str = "compress.residual.";
/// Name prefix of the all-reduce's second-phase residuals (over this rank's shard).
const SHARD_RESIDUAL: &str = "compress.shard_residual.";

impl Compression {
    /// Encodes `values` plus `residual` (when given) into `payload` (exactly
    /// [`Compression::payload_bytes`] long), then sets `residual` to what decoding will lose:
    /// value plus old residual minus decoded value (0 where that is not finite). This is error
    /// feedback's whole step, in one pass.
    ///
    /// # Panics
    /// When `payload` or `residual` has the wrong length.
    pub fn encode(self, values: &[f32], payload: &mut [u8], residual: Option<&mut [f32]>) {
        assert_eq!(payload.len(), self.payload_bytes(values.len()), "payload length for {} values", values.len());
        if let Some(residual) = &residual {
            assert_eq!(residual.len(), values.len(), "residual length");
        }
        codec::encode(Isa::best(), self, values, payload, residual);
    }

    /// Adds the values `payload` encodes to `acc` (`acc.len()` of them).
    ///
    /// # Panics
    /// When `payload` does not encode `acc.len()` values.
    pub fn decode_add(self, payload: &[u8], acc: &mut [f32]) {
        assert_eq!(payload.len(), self.payload_bytes(acc.len()), "payload length for {} values", acc.len());
        codec::decode_add(Isa::best(), self, payload, acc);
    }

    /// Writes the values `payload` encodes into `out` (`out.len()` of them).
    ///
    /// # Panics
    /// When `payload` does not encode `out.len()` values.
    pub fn decode(self, payload: &[u8], out: &mut [f32]) {
        assert_eq!(payload.len(), self.payload_bytes(out.len()), "payload length for {} values", out.len());
        codec::decode(Isa::best(), self, payload, out);
    }
}

/// How a [`Compressor`] communicates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressConfig {
    /// The payload format. Default [`Compression::None`].
    pub compression: Compression,
    /// Keep each encoding's residual and add it to the next step's values. Default true.
    pub error_feedback: bool,
}

impl Default for CompressConfig {
    fn default() -> Self {
        CompressConfig { compression: Compression::None, error_feedback: true }
    }
}

/// Which collective a [`Pending`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Collective {
    ReduceScatter,
    AllReduce,
}

/// A compressed reduction in flight, from `start_*` to [`Compressor::finish`]. It owns the byte
/// buffers the all-to-all reads and writes; dropping it unfinished waits for the exchange.
#[must_use = "a compressed reduction only delivers its result through Compressor::finish"]
pub struct Pending {
    // Declared first, so dropped first: dropping a Work waits for it, so the exchange never
    // outlives the buffers below.
    work: Option<Work>,
    send: Vec<u8>,
    recv: Vec<u8>,
    id: usize,
    len: usize,
    /// Bytes per rank in `send` and `recv` (each chunk padded to the longest).
    segment: usize,
    collective: Collective,
    world_size: usize,
    rank: usize,
}

impl Pending {
    /// The caller's id of the buffer.
    pub fn id(&self) -> usize {
        self.id
    }
    /// Elements of the buffer.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether the exchange has finished (well or not), so that [`Compressor::finish`] will not
    /// wait for it; it never runs the exchange itself.
    pub fn is_done(&self) -> bool {
        self.work.as_ref().is_none_or(Work::is_done)
    }
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("collective", &self.collective)
            .field("segment", &self.segment)
            .finish()
    }
}

/// Compressed averages of fp32 buffers over a communicator's ranks, with their residuals.
#[derive(Debug)]
pub struct Compressor {
    config: CompressConfig,
    /// Residuals by checkpoint name.
    residuals: BTreeMap<String, Vec<f32>>,
    wire_bytes: u64,
    /// Byte buffers of finished exchanges, reused so that a step does not fault in fresh pages.
    spare: Vec<Vec<u8>>,
}

impl Compressor {
    /// A compressor with no residuals yet. Fails on an int8 block of 0 values.
    pub fn new(config: CompressConfig) -> Result<Compressor, TrainError> {
        if let Compression::Int8 { block: 0 } = config.compression {
            return Err(TrainError::InvalidConfig {
                key: "dist.compress_block",
                message: "an int8 block holds at least one value".into(),
            });
        }
        Ok(Compressor { config, residuals: BTreeMap::new(), wire_bytes: 0, spare: Vec::new() })
    }

    pub fn config(&self) -> CompressConfig {
        self.config
    }

    /// Bytes this rank has sent to other ranks so far (payloads and padding; all-to-all and
    /// all-gather phases).
    pub fn wire_bytes(&self) -> u64 {
        self.wire_bytes
    }

    /// Bytes of host memory the residuals hold.
    pub fn residual_bytes(&self) -> usize {
        self.residuals.values().map(|r| 4 * r.len()).sum()
    }

    /// Bytes of host memory held for payloads between steps (the largest set of exchanges in
    /// flight at once so far: two buffers of `world_size` x one shard's payload each).
    pub fn buffer_bytes(&self) -> usize {
        self.spare.iter().map(Vec::capacity).sum::<usize>()
    }

    /// A byte buffer of `bytes` bytes (contents unspecified) from the spares, or a new one: the
    /// smallest spare that holds `bytes` without growing, else the largest (grown), so that
    /// buffers of different sizes in turn do not reallocate (and fault in fresh pages) each step.
    fn buffer(&mut self, bytes: usize) -> Vec<u8> {
        let fits = (0..self.spare.len())
            .filter(|i| self.spare[*i].capacity() >= bytes)
            .min_by_key(|i| self.spare[*i].capacity());
        let largest = (0..self.spare.len()).max_by_key(|i| self.spare[*i].capacity());
        let mut buffer = fits.or(largest).map_or_else(Vec::new, |i| self.spare.swap_remove(i));
        buffer.resize(bytes, 0);
        buffer
    }

    /// Encodes `values` (plus the buffer `id`'s first-phase residual) for every rank and submits
    /// the all-to-all; [`Compressor::finish`] leaves the average of this rank's shard
    /// (`shard_range(values.len(), world_size, rank)`) in the buffer, the rest of it untouched.
    /// Collective: every rank starts the same ids with equal lengths, in the same order relative
    /// to its other operations on `comm`.
    pub fn start_reduce_scatter(
        &mut self,
        comm: &dyn Communicator,
        id: usize,
        values: &[f32],
    ) -> Result<Pending, TrainError> {
        self.start(comm, id, values, Collective::ReduceScatter)
    }

    /// As [`Compressor::start_reduce_scatter`], and [`Compressor::finish`] then leaves the whole
    /// buffer's average, the same bits on every rank.
    pub fn start_all_reduce(
        &mut self,
        comm: &dyn Communicator,
        id: usize,
        values: &[f32],
    ) -> Result<Pending, TrainError> {
        self.start(comm, id, values, Collective::AllReduce)
    }

    /// Waits for `pending`'s exchange, writes the average of this rank's shard into `values`
    /// (the buffer it was started with, or one of the same length), and for an all-reduce runs
    /// the second phase (encode the shard, all-gather, decode every shard into `values`).
    pub fn finish(
        &mut self,
        comm: &dyn Communicator,
        mut pending: Pending,
        values: &mut [f32],
    ) -> Result<(), TrainError> {
        let (n, rank) = (comm.world_size(), comm.rank());
        if values.len() != pending.len || n != pending.world_size || rank != pending.rank {
            return Err(TrainError::InvalidConfig {
                key: "dist.compress",
                message: format!(
                    "buffer {} was started with {} values on rank {} of {} but finished with {} values on rank {rank} of {n}",
                    pending.id, pending.len, pending.rank, pending.world_size, values.len()
                ),
            });
        }
        if let Some(work) = pending.work.take() {
            work.wait().map_err(|e| comm_error(comm, "compressed all_to_all", e))?;
        }
        let codec = self.config.compression;
        let mine = shard_range(pending.len, n, rank);
        let payload = codec.payload_bytes(mine.len());
        let segment = pending.segment;
        let isa = Isa::best();
        // Invariant: the sum runs over ranks 0..n in order on every rank, so a shard's bits do
        // not depend on which rank's payload arrived first.
        let received: Vec<&[u8]> = (0..n).map(|from| &pending.recv[from * segment..from * segment + payload]).collect();
        let divisor = n as f32;
        if pending.collective == Collective::AllReduce {
            // The second phase, fused into the same pass: the averaged shard (plus its own
            // residual) is encoded into this rank's part of the send buffer (free again, and of
            // the size the all-gather needs) and replaced by what the other ranks will decode.
            let mut gathered = std::mem::take(&mut pending.send);
            debug_assert_eq!(gathered.len(), n * segment);
            let residual = self.residual(format!("{SHARD_RESIDUAL}{}", pending.id), mine.len())?;
            let reencode = Reencode {
                payload: &mut gathered[rank * segment..rank * segment + payload],
                residual: residual.map(|r| r.as_mut_slice()),
            };
            codec::reduce(isa, codec, &received, divisor, &mut values[mine.clone()], Some(reencode));
            self.wire_bytes += ((n - 1) * segment) as u64;
            // All-gather cuts n * segment bytes into n shards of exactly `segment` bytes.
            comm.all_gather(&mut gathered).map_err(|e| comm_error(comm, "compressed all_gather", e))?;
            for from in (0..n).filter(|from| *from != rank) {
                let range = shard_range(pending.len, n, from);
                let payload = codec.payload_bytes(range.len());
                codec::decode(isa, codec, &gathered[from * segment..from * segment + payload], &mut values[range]);
            }
            pending.send = gathered;
        } else {
            codec::reduce(isa, codec, &received, divisor, &mut values[mine], None);
        }
        self.spare.push(std::mem::take(&mut pending.send));
        self.spare.push(std::mem::take(&mut pending.recv));
        Ok(())
    }

    /// Start and finish of a reduce-scatter in one call.
    pub fn reduce_scatter(&mut self, comm: &dyn Communicator, id: usize, values: &mut [f32]) -> Result<(), TrainError> {
        let pending = self.start_reduce_scatter(comm, id, values)?;
        self.finish(comm, pending, values)
    }

    /// Start and finish of an all-reduce in one call.
    pub fn all_reduce(&mut self, comm: &dyn Communicator, id: usize, values: &mut [f32]) -> Result<(), TrainError> {
        let pending = self.start_all_reduce(comm, id, values)?;
        self.finish(comm, pending, values)
    }

    /// Every residual by name (`compress.residual.<id>` over a whole buffer,
    /// `compress.shard_residual.<id>` over this rank's shard of it), in name order.
    pub fn residual_state(&self) -> Vec<(&str, &[f32])> {
        self.residuals.iter().map(|(name, values)| (name.as_str(), values.as_slice())).collect()
    }

    /// Replaces every residual with `state` (names as [`Compressor::residual_state`] gives them).
    /// A name that is not a residual's, or a name given twice, is an error and changes nothing.
    /// A residual's length is checked against its buffer when the buffer is next reduced (a
    /// checkpoint of another model or world size fails there, naming the residual).
    pub fn load_residual_state(&mut self, state: Vec<(String, Vec<f32>)>) -> Result<(), TrainError> {
        let mut loaded = BTreeMap::new();
        for (name, values) in state {
            let id = name.strip_prefix(RESIDUAL).or_else(|| name.strip_prefix(SHARD_RESIDUAL));
            if id.and_then(|id| id.parse::<usize>().ok()).is_none() {
                return Err(TrainError::CompressState {
                    name,
                    message: format!("not a residual's name (`{RESIDUAL}<id>` or `{SHARD_RESIDUAL}<id>`)"),
                });
            }
            if loaded.contains_key(&name) {
                return Err(TrainError::CompressState { name, message: "given twice".into() });
            }
            loaded.insert(name, values);
        }
        self.residuals = loaded;
        Ok(())
    }

    fn start(
        &mut self,
        comm: &dyn Communicator,
        id: usize,
        values: &[f32],
        collective: Collective,
    ) -> Result<Pending, TrainError> {
        let (n, rank, len) = (comm.world_size(), comm.rank(), values.len());
        let codec = self.config.compression;
        let segment = (0..n).map(|r| codec.payload_bytes(shard_range(len, n, r).len())).max().unwrap_or(0);
        let mut send = self.buffer(n * segment);
        let mut recv = self.buffer(n * segment);
        let mut residual = self.residual(format!("{RESIDUAL}{id}"), len)?;
        for to in 0..n {
            let range = shard_range(len, n, to);
            let payload = &mut send[to * segment..to * segment + codec.payload_bytes(range.len())];
            let carried = residual.as_deref_mut().map(|r| &mut r[range.clone()]);
            codec.encode(&values[range], payload, carried);
        }
        self.wire_bytes += ((n - 1) * segment) as u64;
        let (send_region, recv_region) = (Region::of(&mut send), Region::of(&mut recv));
        // SAFETY: both regions are the heap buffers of `send` and `recv`, which move into the
        // returned Pending together with the Work; moving a Vec does not move its buffer, nothing
        // else reads or writes them until the Work is waited on (in `finish`), and Pending drops
        // the Work (which waits) before the buffers.
        let work = unsafe { comm.all_to_all_async(send_region, recv_region) }
            .map_err(|e| comm_error(comm, "compressed all_to_all", e))?;
        Ok(Pending { work: Some(work), send, recv, id, len, segment, collective, world_size: n, rank })
    }

    /// The residual named `name` for a buffer of `len` values (zeros when new), or `None` without
    /// error feedback. A stored residual of another length is an error naming it.
    fn residual(&mut self, name: String, len: usize) -> Result<Option<&mut Vec<f32>>, TrainError> {
        if !self.config.error_feedback {
            return Ok(None);
        }
        let residual = self.residuals.entry(name.clone()).or_insert_with(|| vec![0.0; len]);
        if residual.len() != len {
            return Err(TrainError::CompressState {
                name,
                message: format!(
                    "holds {} values but its buffer has {len} (a checkpoint of another model, bucket layout or world size?)",
                    residual.len()
                ),
            });
        }
        Ok(Some(residual))
    }
}

fn comm_error(comm: &dyn Communicator, op: &'static str, source: CommError) -> TrainError {
    TrainError::Comm { rank: comm.rank(), world_size: comm.world_size(), op, source }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use stoke_comm::{connect, shard_range, CommConfig, Communicator, DistEnv};

    use super::{CompressConfig, Compression, Compressor};

    /// A value of rank `rank` at index `i`: a deterministic mix of magnitudes, so blocks differ in
    /// scale and most values are small next to their block's largest.
    fn sample(rank: usize, i: usize) -> f32 {
        let mut z =
            (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        z ^= z >> 31;
        z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 29;
        let unit = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5; // [-0.5, 0.5)
        let magnitude = [1e-3f32, 0.1, 1.0, 30.0][(i / 50) % 4];
        unit * magnitude
    }

    fn single_comm() -> Box<dyn Communicator> {
        connect(&CommConfig::default(), &DistEnv::single()).unwrap()
    }

    #[test]
    fn int8_error_is_at_most_half_a_step_per_block() {
        for block in [1usize, 7, 32, 64, 256] {
            for len in [0usize, 1, 63, 64, 65, 1000, 4099] {
                let values: Vec<f32> = (0..len).map(|i| sample(0, i)).collect();
                let codec = Compression::Int8 { block };
                let mut payload = vec![0u8; codec.payload_bytes(len)];
                assert_eq!(payload.len(), 4 * len.div_ceil(block) + len);
                let mut error = vec![0f32; len];
                codec.encode(&values, &mut payload, Some(&mut error));
                let mut decoded = vec![0f32; len];
                codec.decode(&payload, &mut decoded);
                for (b, chunk) in values.chunks(block).enumerate() {
                    let step = chunk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                    for (k, v) in chunk.iter().enumerate() {
                        let i = b * block + k;
                        let lost = v - decoded[i];
                        assert!(
                            lost.abs() <= step * 0.5 * (1.0 + 1e-5),
                            "block {block}, len {len}, index {i}: {v} decoded as {}, more than half of step {step}",
                            decoded[i]
                        );
                        assert_eq!(error[i], lost, "the reported error is what decoding lost");
                    }
                }
            }
        }
    }

    #[test]
    fn int8_zero_and_non_finite_blocks() {
        let codec = Compression::Int8 { block: 4 };
        let values =
            [0.0, 0.0, 0.0, 0.0, 1.0, f32::INFINITY, 2.0, 3.0, 1.0, f32::NAN, 0.5, 0.25, -127.0, 64.0, 1.0, 0.0];
        let mut payload = vec![0u8; codec.payload_bytes(values.len())];
        let mut error = vec![0f32; values.len()];
        codec.encode(&values, &mut payload, Some(&mut error));
        let mut decoded = vec![0f32; values.len()];
        codec.decode(&payload, &mut decoded);
        assert_eq!(&decoded[..4], &[0.0; 4], "an all-zero block decodes to zeros");
        assert!(decoded[4..12].iter().all(|v| v.is_nan()), "a block with inf or NaN decodes to NaN: {decoded:?}");
        assert_eq!(&decoded[12..], &[-127.0, 64.0, 1.0, 0.0], "multiples of the step are exact");
        assert!(error.iter().all(|e| *e == 0.0), "no residual from exact or non-finite blocks: {error:?}");
        // A carried residual is encoded with the values and, when that is exact, cleared.
        let mut carried = vec![0.5f32; values.len()];
        codec.encode(&[0.0; 16], &mut payload, Some(&mut carried));
        codec.decode(&payload, &mut decoded);
        assert_eq!(decoded, vec![0.5; 16]);
        assert_eq!(carried, vec![0.0; 16]);
    }

    #[test]
    fn bf16_and_fp32_payloads() {
        let values: Vec<f32> = (0..777).map(|i| sample(1, i)).collect();
        let mut payload = vec![0u8; Compression::Bf16.payload_bytes(values.len())];
        assert_eq!(payload.len(), 2 * values.len());
        let mut error = vec![0f32; values.len()];
        Compression::Bf16.encode(&values, &mut payload, Some(&mut error));
        let mut decoded = vec![0f32; values.len()];
        Compression::Bf16.decode(&payload, &mut decoded);
        for ((v, d), e) in values.iter().zip(&decoded).zip(&error) {
            assert!((v - d).abs() <= v.abs() / 256.0, "bf16 keeps 8 significant bits: {v} -> {d}");
            assert_eq!(*e, v - d);
        }
        let mut payload = vec![0u8; Compression::None.payload_bytes(values.len())];
        Compression::None.encode(&values, &mut payload, None);
        Compression::None.decode(&payload, &mut decoded);
        assert_eq!(decoded, values, "fp32 payloads are lossless");
    }

    #[test]
    fn a_block_of_zero_values_is_refused() {
        let config = CompressConfig { compression: Compression::Int8 { block: 0 }, error_feedback: true };
        assert!(Compressor::new(config).is_err());
    }

    /// The largest |sum of what was delivered - sum of the true values| over `steps` all-reduces of
    /// the same buffer, per step, on one rank: one value of 1.0 per block of 64 and the others
    /// below half a quantization step, which int8 alone rounds to zero every time.
    fn drift(error_feedback: bool, steps: usize) -> Vec<f32> {
        let comm = single_comm();
        let config = CompressConfig { compression: Compression::Int8 { block: 64 }, error_feedback };
        let mut compressor = Compressor::new(config).unwrap();
        let truth: Vec<f32> =
            (0..640).map(|i| if i % 64 == 0 { 1.0 } else { 0.001 + 0.0025 * (i % 3) as f32 / 2.0 }).collect();
        let mut sent_sum = vec![0f64; truth.len()];
        let mut worst = Vec::with_capacity(steps);
        for step in 1..=steps {
            let mut values = truth.clone();
            compressor.all_reduce(comm.as_ref(), 7, &mut values).unwrap();
            for (s, v) in sent_sum.iter_mut().zip(&values) {
                *s += f64::from(*v);
            }
            let off =
                sent_sum.iter().zip(&truth).map(|(s, t)| (s - f64::from(*t) * step as f64).abs()).fold(0f64, f64::max);
            worst.push(off as f32);
        }
        worst
    }

    #[test]
    fn error_feedback_keeps_the_running_sum_on_track() {
        let steps = 300;
        let with = drift(true, steps);
        let without = drift(false, steps);
        // Two encodings (the shard's and the gathered one), each at most half a step of 1/127 behind.
        let bound = 2.0 * 0.5 / 127.0 * 1.01;
        let worst_with = with.iter().copied().fold(0f32, f32::max);
        assert!(worst_with <= bound, "with error feedback the drift stays within {bound}, got {worst_with}");
        // Without it the small values are never sent: the drift grows by about 0.001..0.0035 per step.
        assert!(without[steps - 1] > 0.25, "without error feedback the drift grows, got {}", without[steps - 1]);
        assert!(without[steps - 1] > 1.8 * without[steps / 2 - 1], "and keeps growing: {without:?}");
    }

    #[test]
    fn residuals_round_trip_and_are_checked() {
        let comm = single_comm();
        let config = CompressConfig { compression: Compression::Int8 { block: 16 }, error_feedback: true };
        let mut compressor = Compressor::new(config).unwrap();
        let mut values: Vec<f32> = (0..100).map(|i| sample(0, i)).collect();
        compressor.all_reduce(comm.as_ref(), 3, &mut values).unwrap();
        let state: Vec<(String, Vec<f32>)> =
            compressor.residual_state().into_iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect();
        let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["compress.residual.3", "compress.shard_residual.3"]);
        assert!(state[0].1.iter().any(|r| *r != 0.0), "the first encoding lost something");

        // A restored compressor continues exactly like the original.
        let mut restored = Compressor::new(config).unwrap();
        restored.load_residual_state(state.clone()).unwrap();
        let next: Vec<f32> = (0..100).map(|i| sample(1, i)).collect();
        let (mut a, mut b) = (next.clone(), next.clone());
        compressor.all_reduce(comm.as_ref(), 3, &mut a).unwrap();
        restored.all_reduce(comm.as_ref(), 3, &mut b).unwrap();
        assert_eq!(a, b);

        // Wrong names are refused whole; a wrong length is named when its buffer is reduced.
        let mut other = Compressor::new(config).unwrap();
        let err = other.load_residual_state(vec![("optim.x".into(), vec![0.0])]).unwrap_err();
        assert!(err.to_string().contains("optim.x"), "{err}");
        other.load_residual_state(vec![("compress.residual.3".into(), vec![0.0; 99])]).unwrap();
        let err = other.all_reduce(comm.as_ref(), 3, &mut b).unwrap_err();
        assert!(err.to_string().contains("compress.residual.3") && err.to_string().contains("99"), "{err}");
    }

    #[test]
    fn reduce_scatter_and_all_reduce_count_wire_bytes() {
        let comm = single_comm();
        let mut compressor = Compressor::new(CompressConfig::default()).unwrap();
        let mut values = vec![1.0f32; 10];
        compressor.reduce_scatter(comm.as_ref(), 0, &mut values).unwrap();
        compressor.all_reduce(comm.as_ref(), 0, &mut values).unwrap();
        assert_eq!(values, vec![1.0; 10]);
        assert_eq!(compressor.wire_bytes(), 0, "one rank sends nothing to others");
        let mut short = vec![0f32; 9];
        let pending = compressor.start_all_reduce(comm.as_ref(), 1, &values).unwrap();
        assert!(compressor.finish(comm.as_ref(), pending, &mut short).is_err(), "finish checks the length");
    }

    // ---- Multi-process: real processes, this test binary started once per rank. ----

    const WORKER_VAR: &str = "STOKE_COMPRESS_TEST_WORKER";
    const LEN: usize = 10_007;

    /// Bound on |compressed average - exact average| at each index of `range` (one destination
    /// shard) after one encoding of every rank's values and, with `second`, one more of the shard
    /// average, for a fresh compressor (no residual yet).
    fn bound(codec: Compression, n: usize, range: std::ops::Range<usize>, second: bool) -> Vec<f32> {
        let values: Vec<Vec<f32>> = (0..n).map(|r| range.clone().map(|i| sample(r, i)).collect()).collect();
        let mean_abs: Vec<f32> =
            (0..range.len()).map(|k| values.iter().map(|v| v[k].abs()).sum::<f32>() / n as f32).collect();
        let slop: Vec<f32> = mean_abs.iter().map(|m| 1e-6 * n as f32 * m + 1e-12).collect();
        match codec {
            Compression::None => slop,
            Compression::Bf16 => mean_abs
                .iter()
                .zip(&slop)
                .map(|(m, s)| {
                    let first = m / 256.0;
                    first + if second { (m + first) / 256.0 } else { 0.0 } + s
                })
                .collect(),
            Compression::Int8 { block } => {
                let mut first = vec![0f32; range.len()];
                for v in &values {
                    for (b, chunk) in v.chunks(block).enumerate() {
                        let half_step = chunk.iter().fold(0f32, |m, x| m.max(x.abs())) / 254.0 / n as f32;
                        first[b * block..b * block + chunk.len()].iter_mut().for_each(|f| *f += half_step);
                    }
                }
                let mut total = first.clone();
                if second {
                    for b in 0..range.len().div_ceil(block) {
                        let span = b * block..((b + 1) * block).min(range.len());
                        let top = span.clone().map(|k| mean_abs[k] + first[k]).fold(0f32, f32::max);
                        total[span].iter_mut().for_each(|t| *t += top / 254.0);
                    }
                }
                total.iter().zip(&slop).map(|(t, s)| t * 1.001 + s).collect()
            }
        }
    }

    fn exact_mean(n: usize, i: usize) -> f32 {
        ((0..n).map(|r| f64::from(sample(r, i))).sum::<f64>() / n as f64) as f32
    }

    fn check_within(what: &str, got: &[f32], range: std::ops::Range<usize>, n: usize, bound: &[f32]) {
        for (k, i) in range.enumerate() {
            let want = exact_mean(n, i);
            assert!(
                (got[i] - want).abs() <= bound[k],
                "{what}: index {i} is {}, the exact mean {want}, off by {} > bound {}",
                got[i],
                (got[i] - want).abs(),
                bound[k]
            );
        }
    }

    /// One rank's checks: every format, reduce-scatter and all-reduce of `LEN` values against
    /// the exact mean within the formats' bounds; prints a fingerprint of each all-reduce's bits.
    fn rank_checks(comm: &dyn Communicator) {
        let (n, rank) = (comm.world_size(), comm.rank());
        let codecs = [
            ("fp32", Compression::None),
            ("bf16", Compression::Bf16),
            ("int8-64", Compression::Int8 { block: 64 }),
            ("int8-1000", Compression::Int8 { block: 1000 }),
        ];
        for (name, codec) in codecs {
            for error_feedback in [true, false] {
                let config = CompressConfig { compression: codec, error_feedback };
                let mut compressor = Compressor::new(config).unwrap();
                let input: Vec<f32> = (0..LEN).map(|i| sample(rank, i)).collect();

                let mut values = input.clone();
                compressor.reduce_scatter(comm, 0, &mut values).unwrap();
                let mine = shard_range(LEN, n, rank);
                check_within(
                    &format!("{name} reduce_scatter"),
                    &values,
                    mine.clone(),
                    n,
                    &bound(codec, n, mine.clone(), false),
                );
                for i in (0..LEN).filter(|i| !mine.contains(i)) {
                    assert_eq!(
                        values[i].to_bits(),
                        input[i].to_bits(),
                        "{name} reduce_scatter wrote outside its shard at {i}"
                    );
                }

                // Two buffers in flight at once, finished in reverse order, as a trainer's buckets are.
                let mut a = input.clone();
                let mut b: Vec<f32> = input.iter().map(|v| -v).collect();
                let pending_a = compressor.start_all_reduce(comm, 1, &a).unwrap();
                let pending_b = compressor.start_all_reduce(comm, 2, &b).unwrap();
                compressor.finish(comm, pending_b, &mut b).unwrap();
                assert!(pending_a.is_done(), "{name}: exchanges run in order, so the earlier one is done");
                compressor.finish(comm, pending_a, &mut a).unwrap();
                for shard in 0..n {
                    let range = shard_range(LEN, n, shard);
                    check_within(&format!("{name} all_reduce"), &a, range.clone(), n, &bound(codec, n, range, true));
                }
                for (x, y) in a.iter().zip(&b) {
                    assert_eq!(*x, -*y, "{name}: the negated buffer gives the negated mean");
                }
                let fingerprint = a
                    .iter()
                    .fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3));
                println!("fingerprint {name} ef={error_feedback} {fingerprint:016x}");

                // Bytes on the wire: two phases of n - 1 padded shards each, on top of the reduce-scatter's one.
                let shard_bytes = (0..n).map(|s| codec.payload_bytes(shard_range(LEN, n, s).len())).max().unwrap();
                assert_eq!(compressor.wire_bytes(), (5 * (n - 1) * shard_bytes) as u64, "{name} wire bytes");
            }
        }
        println!("compress rank {rank} of {n}: all checks passed");
    }

    #[test]
    #[ignore = "one rank of `compressed_averages_on_2_and_3_processes`, started by it"]
    fn rank_worker() {
        let vars: HashMap<String, String> = std::env::vars().collect();
        assert!(vars.contains_key(WORKER_VAR), "started by compressed_averages_on_2_and_3_processes only");
        let env = DistEnv::from_vars(&vars).unwrap();
        let config = CommConfig { timeout_s: 60.0, ..CommConfig::default() };
        let comm = connect(&config, &env).unwrap();
        rank_checks(comm.as_ref());
    }

    #[test]
    fn compressed_averages_on_2_and_3_processes() {
        let test_name = format!("{}::rank_worker", module_path!().split_once("::").unwrap().1);
        let exe = std::env::current_exe().unwrap();
        for n in [2usize, 3] {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let children: Vec<_> = (0..n)
                .map(|rank| {
                    Command::new(&exe)
                        .args([test_name.as_str(), "--exact", "--ignored", "--nocapture", "--test-threads=1"])
                        .env(WORKER_VAR, "1")
                        .env("RANK", rank.to_string())
                        .env("WORLD_SIZE", n.to_string())
                        .env("LOCAL_RANK", rank.to_string())
                        .env("LOCAL_WORLD_SIZE", n.to_string())
                        .env("MASTER_ADDR", "127.0.0.1")
                        .env("MASTER_PORT", port.to_string())
                        .stdin(Stdio::null())
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            let deadline = Instant::now() + Duration::from_secs(300);
            let mut outputs = Vec::new();
            for (rank, mut child) in children.into_iter().enumerate() {
                while child.try_wait().unwrap().is_none() {
                    if Instant::now() > deadline {
                        let _ = child.kill();
                        panic!("rank {rank} of {n} hung");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let out = child.wait_with_output().unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
                assert!(
                    out.status.success() && stdout.contains(&format!("compress rank {rank} of {n}: all checks passed")),
                    "rank {rank} of {n} failed:\n{stdout}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                outputs.push(stdout);
            }
            let fingerprints = |s: &str| -> Vec<String> {
                // The test harness prints its own words before the first line of the test's output.
                s.lines().filter_map(|l| l.find("fingerprint ").map(|at| l[at..].to_string())).collect()
            };
            let first = fingerprints(&outputs[0]);
            assert_eq!(first.len(), 8, "{}", outputs[0]);
            for (rank, out) in outputs.iter().enumerate().skip(1) {
                assert_eq!(fingerprints(out), first, "rank {rank} of {n} holds other bits than rank 0");
            }
        }
    }
}
