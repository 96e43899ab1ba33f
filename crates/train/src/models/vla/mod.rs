//! The vision-language-action model (`model.family = "vla"`): camera frames, an instruction and
//! the robot's state in, a chunk of future actions out.
//!
//! One residual stream of width d carries the sequence [frame patches, instruction tokens, the
//! state, the action chunk]. The embedding unit cuts each frame into patches and projects them with
//! one matrix multiply (a ViT's patch embedding), embeds the instruction's tokens, projects the
//! state, and embeds the action chunk the head is trained on: under flow matching the noised chunk
//! `(1 - t)·noise + t·actions` with its time t (sinusoidal features through a two-layer MLP), as
//! GR00T's and π0's action experts take it, plus the state's embedding. The first `vision_layers`
//! blocks are the vision tower: bidirectional attention within each frame's patches, each block's
//! input first scaled and shifted by a FiLM layer of the instruction's summary (RT-1's
//! conditioning: the tower is told what to look for), the rest of the sequence passed through
//! untouched. A projector (a linear layer at the start of the first backbone block's unit) maps the
//! tower's output into the backbone, and a spatial-softmax readout of it (keypoints: the expected
//! patch coordinates under learned maps, as visuomotor policies read an image) is added to the
//! chunk's tokens (where things are, in the chunk's own stream); the backbone's blocks attend over
//! the whole sequence with a prefix mask: frames, instruction and state attend to one another both
//! ways, the action chunk attends to everything, and nothing in the prefix attends to the chunk.
//! The head (final LayerNorm, a linear layer) reads the chunk's positions: the velocity `actions -
//! noise` under flow matching (the squared error over the actions that exist, divided by the values
//! of full chunks), or the actions themselves under `train.action_loss = "l1"` (the absolute error,
//! likewise). With `train.instruction_lm` above 0 the head also reads the instruction's positions
//! through the final norm and the token embedding's rows (tied) and adds that weight times the
//! next-token cross-entropy over the instruction's tokens (summed over the present targets, over
//! the batch's possible targets, as the action loss counts); the prefix mask then lets the frames
//! attend only to frames, each instruction token to the frames and to itself and the tokens before
//! it, the state to the whole prefix, so no token sees the one it predicts through any path.
//! Evaluation integrates the flow from the noise with `flow_steps` Euler steps and reports the
//! squared error of the actions it ends at, likewise.
//!
//! Blocks are GPT-2's (LayerNorm, biases, GELU MLP of 4d), in libtorch's graph in the compute type
//! with norms in fp32, or on a CPU whole by hand under the block executor (`by_hand.rs`); every
//! unit goes through the model seam, so the block executor, recomputation, data parallelism, ZeRO
//! and checkpoints treat it like the text families.

use tch::{Device, Kind, Tensor};

use crate::config::{ActionLoss, GptShape, Precision, VlaShape, VLA_KEYPOINTS};
use crate::models::embedding::embed;
use crate::models::{BlockBackward, Branch, EpisodeInputs, HeadLoss, Inputs, Model, Norm};
use crate::params::{FlatParams, Init, ParamSpec, UnitSpec};
use crate::precision::{compute_kind, Products};

const LAYER_NORM_EPS: f64 = 1e-5;

/// What the vision blocks' FiLM layers read: this times the sum of the instruction's positions of
/// the stream (its tokens' embedding rows and positions, which the tower passes through; padding
/// holds zeros). The rows start at N(0, 0.02); at this scale an Adam step moves the modulation as
/// much as a step moves a weight of the tower, so the tower learns to look for the colour it is
/// told within a thousand steps (`benches/vla_grounding_probe.py`, RESULTS "What the tower needs to be told").
const SUMMARY_SCALE: f64 = 30.0;

/// The planner's description of this family: its units' parameters and FLOPs (`models::plan_model`).
pub(crate) fn plan_model(shape: &VlaShape) -> stoke_plan::ModelConfig {
    let base = shape.base;
    let gpt = stoke_plan::ModelConfig::gpt(base.n_layer, base.d_model, base.n_head, base.seq_len, base.vocab_size);
    stoke_plan::ModelConfig {
        flash_attention: true,
        units: Some(stoke_plan::ExplicitUnits {
            embedding: shape.embedding_params() as u64,
            blocks: (0..base.n_layer)
                .map(|layer_idx| {
                    let projector = if layer_idx == shape.vision_layers { shape.projector_params() } else { 0 };
                    let film = if layer_idx < shape.vision_layers { shape.film_params() } else { 0 };
                    (shape.block_params() + projector + film) as u64
                })
                .collect(),
            head: shape.head_params() as u64,
            flops_per_token: shape.flops_per_sample() / base.seq_len as f64,
        }),
        ..gpt
    }
}

/// One block's parameters: GPT-2's, with biases.
struct BlockParams {
    ln_1: (Tensor, Tensor),
    attn: (Tensor, Tensor),
    attn_proj: (Tensor, Tensor),
    ln_2: (Tensor, Tensor),
    fc: (Tensor, Tensor),
    mlp_proj: (Tensor, Tensor),
}

pub struct Vla {
    shape: VlaShape,
    params: FlatParams,
    compute: Kind,
    /// The matrix products in `compute`, widened to fp32 on a CPU that does not multiply bf16.
    products: Products,
    action_loss: ActionLoss,
    /// The instruction's language-model loss weight; 0 leaves it out (and the prefix mask whole).
    instruction_lm: f64,
    patch_embed: (Tensor, Tensor),
    vision_pos: Tensor,
    wte: Tensor,
    wpe: Tensor,
    state_proj: (Tensor, Tensor),
    action_in: (Tensor, Tensor),
    time_mlp: [(Tensor, Tensor); 2],
    action_pos: Tensor,
    blocks: Vec<BlockParams>,
    projector: (Tensor, Tensor),
    /// The spatial-softmax readout: per frame, `VLA_KEYPOINTS` maps' logits over the projected
    /// patches, and the layer from their expected coordinates into the chunk's tokens.
    keypoint_logits: (Tensor, Tensor),
    keypoint_proj: (Tensor, Tensor),
    /// `[patches_per_frame, 2]` fp32: each patch's column and row, scaled to [-1, 1].
    keypoint_grid: Tensor,
    /// Per vision block, the FiLM layer that scales and shifts its input by the instruction.
    films: Vec<(Tensor, Tensor)>,
    ln_f: (Tensor, Tensor),
    action_out: (Tensor, Tensor),
    /// `[seq, seq]`, 0 where a backbone position may attend (the prefix within itself, the action
    /// chunk everywhere; `prefix_mask`) and -inf where not, in the compute type, added to the scores.
    backbone_bias: Tensor,
    /// The same mask as the keys each backbone row sees, `0..backbone_keys[row]` (every row's
    /// allowed columns are a prefix of the sequence: `prefix_mask`).
    backbone_keys: Vec<usize>,
    /// Every tower row sees its whole frame: `patches_per_frame` keys for each of its rows.
    tower_keys: Vec<usize>,
    /// Attention as batched matrix multiplies and a softmax, else libtorch's
    /// scaled_dot_product_attention: in the vision tower and in the backbone apart.
    math_attention: [bool; 2],
    /// The kernels' threads when blocks run whole by hand (`set_blocks_by_hand`); 0: off.
    by_hand_threads: usize,
}

/// The backbone's mask `[seq, seq]` bool, true where row i may attend to column j: the chunk to
/// everything, nothing in the prefix to the chunk; within the prefix everything both ways, or with
/// `causal_instruction` frames to frames, instruction tokens to frames and to the instruction's
/// tokens up to their own, the state to the whole prefix.
fn prefix_mask(shape: &VlaShape, causal_instruction: bool, device: Device) -> Tensor {
    let seq = shape.base.seq_len as i64;
    let prefix = seq - shape.chunk as i64;
    let (vision, text) = (shape.vision_tokens() as i64, shape.instruction_tokens as i64);
    let positions = Tensor::arange(seq, (Kind::Int64, device));
    let (row, col) = (positions.unsqueeze(1), positions.unsqueeze(0));
    let whole_prefix = col.lt(prefix).logical_or(&row.ge(prefix));
    if !causal_instruction {
        return whole_prefix;
    }
    let in_range = |t: &Tensor, from: i64, to: i64| t.ge(from).logical_and(&t.lt(to));
    let frames_row = in_range(&row, 0, vision).logical_and(&col.lt(vision));
    let text_row = in_range(&row, vision, vision + text).logical_and(
        &col.lt(vision).logical_or(&in_range(&col, vision, vision + text).logical_and(&col.le_tensor(&row))),
    );
    let later_rows = row.ge(vision + text).logical_and(&whole_prefix);
    frames_row.logical_or(&text_row).logical_or(&later_rows)
}

/// Whether the vision tower and the backbone (in that order) run attention as batched matrix
/// multiplies and a softmax rather than libtorch's scaled_dot_product_attention: on a CPU the
/// tower always, the backbone (under its prefix mask) in 16 bits, where SDPA's backward is the
/// slower; in fp32 the backbone takes SDPA's flash kernel. Measured on `vla-small` at micro-batch 8
/// (benches/RESULTS.md, "Vision-language-action model"); on a GPU, SDPA throughout.
fn math_attention(device: Device, kind: Kind) -> [bool; 2] {
    match device {
        Device::Cpu => [true, kind != Kind::Float],
        _ => [false, false],
    }
}

/// For a mask `[seq, seq]` whose every row allows a prefix of the columns: each row's count.
fn row_keys(mask: &Tensor) -> Vec<usize> {
    let seq = mask.size()[1];
    let counts: Vec<i64> =
        Vec::try_from(mask.sum_dim_intlist([1i64].as_slice(), false, Kind::Int64)).expect("int64 counts");
    let prefixes = Tensor::from_slice(&counts).unsqueeze(1).gt_tensor(&Tensor::arange(seq, (Kind::Int64, Device::Cpu)));
    assert!(
        prefixes.equal(&mask.to_device(Device::Cpu)),
        "every row of the prefix mask allows a prefix of the columns"
    );
    counts.into_iter().map(|c| c as usize).collect()
}

/// `mask` as 0 (attend) or -inf (not) in `kind`.
fn additive(mask: &Tensor, kind: Kind) -> Tensor {
    Tensor::zeros(mask.size(), (kind, mask.device())).masked_fill(&mask.logical_not(), f64::NEG_INFINITY)
}

/// MAE's 2-D sine-cosine position table for a `grid` x `grid` patch grid, `[grid * grid, d]`, rows
/// in row-major patch order: the first half of each row encodes the patch's row, the second its
/// column, each as sines then cosines of the position at frequencies 1 / 10000^(i / (d / 4)).
fn sincos_2d(grid: usize, d: usize) -> Tensor {
    let quarter = d / 4;
    let mut table = vec![0f32; grid * grid * d];
    for (patch, row) in table.chunks_mut(d).enumerate() {
        for (half, position) in [(0, patch / grid), (1, patch % grid)] {
            for i in 0..quarter {
                let angle = position as f64 / 10000f64.powf(i as f64 / quarter as f64);
                row[half * 2 * quarter + i] = angle.sin() as f32;
                row[half * 2 * quarter + quarter + i] = angle.cos() as f32;
            }
        }
    }
    Tensor::from_slice(&table).view([(grid * grid) as i64, d as i64])
}

/// Each patch's (column, row) of a `grid` x `grid` patch grid, scaled to [-1, 1], `[grid * grid, 2]`
/// fp32, rows in row-major patch order.
fn keypoint_grid(grid: usize) -> Tensor {
    let scale = |i: usize| if grid > 1 { 2.0 * i as f32 / (grid - 1) as f32 - 1.0 } else { 0.0 };
    let table: Vec<f32> = (0..grid * grid).flat_map(|patch| [scale(patch % grid), scale(patch / grid)]).collect();
    Tensor::from_slice(&table).view([(grid * grid) as i64, 2])
}

fn block_prefix(shape: &VlaShape, layer_idx: usize) -> String {
    if layer_idx < shape.vision_layers {
        format!("vision.blocks.{layer_idx}")
    } else {
        format!("backbone.blocks.{}", layer_idx - shape.vision_layers)
    }
}

impl Vla {
    /// A freshly initialized model (N(0, 0.02) weights, residual projections scaled by
    /// 1/sqrt(2·blocks), zero biases, unit norms, the patches' positions a 2-D sine-cosine table;
    /// seed libtorch first). Units: the embedding,
    /// each block (the projector first in the first backbone block's), the head.
    pub fn new(shape: VlaShape, precision: Precision, action_loss: ActionLoss, device: Device) -> Vla {
        let d = shape.base.d_model as i64;
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * shape.base.n_layer as f64).sqrt();
        let spec = |name: String, dims: &[i64], init: Init| ParamSpec {
            decay: dims.len() >= 2,
            name,
            shape: dims.to_vec(),
            init,
        };
        let linear = |name: &str, out: i64, inp: i64, std: f64| {
            [
                spec(format!("{name}.weight"), &[out, inp], Init::Normal { std }),
                spec(format!("{name}.bias"), &[out], Init::Zeros),
            ]
        };
        let norm = |name: &str| {
            [spec(format!("{name}.weight"), &[d], Init::Ones), spec(format!("{name}.bias"), &[d], Init::Zeros)]
        };
        // PyTorch's default bound for a linear layer's weight of `fan_in` inputs.
        let uniform = |fan_in: i64| Init::Uniform { bound: 1.0 / (fan_in as f64).sqrt() };
        let mut embedding = Vec::new();
        embedding.extend(linear("vision.patch_embed", d, shape.patch_dim() as i64, std));
        embedding.push(spec("vision.pos_embed".into(), &[shape.vision_tokens() as i64, d], Init::Normal { std }));
        embedding.push(spec("text.wte.weight".into(), &[shape.base.vocab_size as i64, d], Init::Normal { std }));
        embedding.push(spec("text.wpe.weight".into(), &[shape.instruction_tokens as i64, d], Init::Normal { std }));
        embedding.extend(linear("state_proj", d, shape.state_dim as i64, std));
        embedding.extend(linear("action_in", d, shape.action_dim as i64, std));
        embedding.extend(linear("time_mlp.0", d, d, std));
        embedding.extend(linear("time_mlp.2", d, d, std));
        embedding.push(spec("action_pos".into(), &[shape.chunk as i64, d], Init::Normal { std }));
        let mut units = vec![UnitSpec { name: "embedding".into(), params: embedding }];
        for layer_idx in 0..shape.base.n_layer {
            let p = block_prefix(&shape, layer_idx);
            let mut params = Vec::new();
            if layer_idx == shape.vision_layers {
                params.extend(linear("projector", d, d, std));
                // PyTorch's default init: the maps start sharp enough that their coordinates move
                // with what the patches hold.
                let (k, kp_in) = (VLA_KEYPOINTS as i64, (shape.frames * 2 * VLA_KEYPOINTS) as i64);
                params.push(spec("keypoints.logits.weight".into(), &[k, d], uniform(d)));
                params.push(spec("keypoints.logits.bias".into(), &[k], Init::Zeros));
                params.push(spec("keypoints.proj.weight".into(), &[d, kp_in], uniform(kp_in)));
                params.push(spec("keypoints.proj.bias".into(), &[d], Init::Zeros));
            }
            if layer_idx < shape.vision_layers {
                // PyTorch's default init, as the probe's FiLM layers.
                params.push(spec(format!("{p}.film.weight"), &[2 * d, d], uniform(d)));
                params.push(spec(format!("{p}.film.bias"), &[2 * d], Init::Zeros));
            }
            params.extend(norm(&format!("{p}.ln_1")));
            params.extend(linear(&format!("{p}.attn.c_attn"), 3 * d, d, std));
            params.extend(linear(&format!("{p}.attn.c_proj"), d, d, proj_std));
            params.extend(norm(&format!("{p}.ln_2")));
            params.extend(linear(&format!("{p}.mlp.c_fc"), 4 * d, d, std));
            params.extend(linear(&format!("{p}.mlp.c_proj"), d, 4 * d, proj_std));
            units.push(UnitSpec { name: p, params });
        }
        let mut head = Vec::from(norm("ln_f"));
        head.extend(linear("action_out", shape.action_dim as i64, d, std));
        units.push(UnitSpec { name: "head".into(), params: head });
        let params = FlatParams::new(units, device);
        let get = |name: &str| params.get(name).shallow_clone();
        let pair = |name: &str| (get(&format!("{name}.weight")), get(&format!("{name}.bias")));
        let blocks = (0..shape.base.n_layer)
            .map(|layer_idx| {
                let p = block_prefix(&shape, layer_idx);
                BlockParams {
                    ln_1: pair(&format!("{p}.ln_1")),
                    attn: pair(&format!("{p}.attn.c_attn")),
                    attn_proj: pair(&format!("{p}.attn.c_proj")),
                    ln_2: pair(&format!("{p}.ln_2")),
                    fc: pair(&format!("{p}.mlp.c_fc")),
                    mlp_proj: pair(&format!("{p}.mlp.c_proj")),
                }
            })
            .collect();
        // The patches' positions start as MAE's fixed 2-D sine-cosine table (then train), so a
        // patch's place is linearly readable from the first step: a learned table from N(0, 0.02)
        // leaves the model to discover the grid before it can say where anything is.
        tch::no_grad(|| {
            let table = sincos_2d(shape.image_side / shape.patch, shape.base.d_model).repeat([shape.frames as i64, 1]);
            let _ = params.get("vision.pos_embed").shallow_clone().copy_(&table.to_device(device));
        });
        let mask = prefix_mask(&shape, false, device);
        Vla {
            patch_embed: pair("vision.patch_embed"),
            vision_pos: get("vision.pos_embed"),
            wte: get("text.wte.weight"),
            wpe: get("text.wpe.weight"),
            state_proj: pair("state_proj"),
            action_in: pair("action_in"),
            time_mlp: [pair("time_mlp.0"), pair("time_mlp.2")],
            action_pos: get("action_pos"),
            projector: pair("projector"),
            keypoint_logits: pair("keypoints.logits"),
            keypoint_proj: pair("keypoints.proj"),
            keypoint_grid: keypoint_grid(shape.image_side / shape.patch).to_device(device),
            films: (0..shape.vision_layers).map(|layer_idx| pair(&format!("vision.blocks.{layer_idx}.film"))).collect(),
            ln_f: pair("ln_f"),
            action_out: pair("action_out"),
            blocks,
            backbone_bias: additive(&mask, compute_kind(precision)),
            backbone_keys: row_keys(&mask),
            tower_keys: vec![shape.patches_per_frame(); shape.patches_per_frame()],
            math_attention: math_attention(device, compute_kind(precision)),
            by_hand_threads: 0,
            shape,
            params,
            compute: compute_kind(precision),
            products: Products::new(compute_kind(precision), device),
            action_loss,
            instruction_lm: 0.0,
        }
    }

    /// Sets `train.instruction_lm`: the weight of the instruction's language-model loss, and with
    /// a weight above 0 the prefix mask that keeps each instruction token from seeing the next.
    pub fn set_instruction_lm(&mut self, weight: f64) {
        self.instruction_lm = weight;
        let mask = prefix_mask(&self.shape, weight > 0.0, self.backbone_bias.device());
        self.backbone_bias = additive(&mask, self.compute);
        self.backbone_keys = row_keys(&mask);
    }

    pub fn vla_shape(&self) -> VlaShape {
        self.shape
    }

    /// Whether bf16's matrix products run in fp32 (`Products`); by default where the CPU does not
    /// multiply bf16 natively.
    pub fn set_widened_products(&mut self, widen: bool) {
        self.products = Products::with(self.compute, widen);
    }

    /// A linear layer in the compute type (input, weight and bias cast, as autocast does).
    fn linear(&self, x: &Tensor, (weight, bias): &(Tensor, Tensor)) -> Tensor {
        if self.compute == Kind::Float {
            return x.linear(weight, Some(bias));
        }
        self.products.linear(&x.to_kind(self.compute), &weight.to_kind(self.compute), Some(&bias.to_kind(self.compute)))
    }

    /// Vision block `layer_idx`'s input `v` scaled and shifted by its FiLM layer, `v·(1 + scale) +
    /// shift`, from the instruction's summary (RT-1's conditioning of its vision tower): the tower
    /// looks for what it is told to. `rest` is the stream after the vision tokens, which starts
    /// with the instruction's positions. Under the instruction's language-model
    /// loss the summary is zero (the frames, which every instruction token reads, would carry the
    /// tokens after it).
    fn film(&self, layer_idx: usize, rest: &Tensor, v: &Tensor) -> Tensor {
        let text = self.shape.instruction_tokens as i64;
        let summary = rest.narrow(1, 0, text).sum_dim_intlist([1i64].as_slice(), false, Kind::Float) * SUMMARY_SCALE;
        let summary = if self.instruction_lm > 0.0 { summary.zeros_like() } else { summary };
        let modulation = self.linear(&summary, &self.films[layer_idx]).to_kind(Kind::Float).unsqueeze(1);
        let parts = modulation.chunk(2, -1);
        v * (&parts[0] + 1.0) + &parts[1]
    }

    /// The stream `x` with the tower's output projected into the backbone, and its keypoints added
    /// to the chunk's tokens: where things are in the frames, in the chunk's own stream from the
    /// first backbone block on (the start of that block's unit).
    fn project_tower(&self, x: &Tensor) -> Tensor {
        let vision = self.shape.vision_tokens() as i64;
        let (rest, chunk) = (self.shape.base.seq_len as i64 - vision, self.shape.chunk as i64);
        let parts = x.split_with_sizes([vision, rest - chunk, chunk], 1);
        let projected = self.linear(&parts[0], &self.projector).to_kind(Kind::Float);
        let keypoints = self.keypoints(&projected);
        Tensor::cat(&[&projected, &parts[1], &(&parts[2] + keypoints)], 1)
    }

    /// The spatial-softmax readout of the projected vision tokens `[batch, vision_tokens, d]`
    /// fp32 (as Diffusion Policy's and Levine et al.'s visuomotor encoders read an image): each of
    /// `VLA_KEYPOINTS` maps is a softmax over a frame's patches, its keypoint the expected patch
    /// coordinates under it; every frame's keypoints through a linear layer, `[batch, 1, d]` fp32.
    /// Coordinates, not features: the chunk reads where the tower found something without
    /// finding the patch itself through attention, which the backbone learns far more slowly
    /// (`benches/vla_grounding_probe.py`, RESULTS "Does it use what it sees and what it is told?").
    fn keypoints(&self, projected: &Tensor) -> Tensor {
        let coords = self.keypoint_coords(projected).flatten(1, -1);
        self.linear(&coords, &self.keypoint_proj).to_kind(Kind::Float).unsqueeze(1)
    }

    /// Each frame's keypoints, `[batch, frames, VLA_KEYPOINTS, 2]` fp32: (column, row) in [-1, 1].
    fn keypoint_coords(&self, projected: &Tensor) -> Tensor {
        let (batch, frames) = (projected.size()[0], self.shape.frames as i64);
        let per_frame = self.shape.patches_per_frame() as i64;
        let logits = self.linear(projected, &self.keypoint_logits).to_kind(Kind::Float);
        let maps = logits.view([batch, frames, per_frame, VLA_KEYPOINTS as i64]).softmax(2, Kind::Float);
        maps.transpose(2, 3).matmul(&self.keypoint_grid)
    }

    /// LayerNorm, in fp32.
    fn layer_norm(&self, x: &Tensor, (weight, bias): &(Tensor, Tensor)) -> Tensor {
        let d = self.shape.base.d_model as i64;
        x.to_kind(Kind::Float).layer_norm([d], Some(weight), Some(bias), LAYER_NORM_EPS, true)
    }

    fn episode<'i>(inputs: &'i Inputs) -> &'i EpisodeInputs {
        inputs.episode.as_ref().expect("a vla model is fed episodes (the run checks its data when it starts)")
    }

    /// The frames' patches projected, plus their positions: `[batch, vision_tokens, d]` fp32.
    fn patches(&self, frames: &Tensor) -> Tensor {
        let s = &self.shape;
        let (p, grid) = (s.patch as i64, (s.image_side / s.patch) as i64);
        let batch = frames.size()[0];
        // uint8 [0, 255] to [-1, 1], as the peer's torchvision Normalize(0.5, 0.5) gives.
        let x = frames.to_kind(Kind::Float) / 127.5 - 1.0;
        let x = x
            .view([batch, s.frames as i64, grid, p, grid, p, 3].as_slice())
            .permute([0, 1, 2, 4, 3, 5, 6].as_slice())
            .reshape([batch, s.vision_tokens() as i64, s.patch_dim() as i64]);
        self.linear(&x, &self.patch_embed).to_kind(Kind::Float) + &self.vision_pos
    }

    /// The flow time's embedding, `[batch, 1, d]`: sinusoidal features of 1000·t through the MLP.
    fn time_embedding(&self, time: &Tensor) -> Tensor {
        let d = self.shape.base.d_model as i64;
        let half = d / 2;
        let device = time.device();
        let freqs = (Tensor::arange(half, (Kind::Float, device)) * (-(10000f64.ln()) / half as f64)).exp();
        let angles = (time * 1000.0).unsqueeze(1) * freqs.unsqueeze(0);
        let features = Tensor::cat(&[angles.sin(), angles.cos()], 1);
        let hidden = self.linear(&features, &self.time_mlp[0]).silu();
        self.linear(&hidden, &self.time_mlp[1]).to_kind(Kind::Float).unsqueeze(1)
    }

    /// The state's embedding, `[batch, 1, d]` fp32.
    fn state_embedding(&self, episode: &EpisodeInputs) -> Tensor {
        self.linear(&episode.state, &self.state_proj).to_kind(Kind::Float).unsqueeze(1)
    }

    /// The action chunk's tokens from `actions_in` (the noised chunk) at flow time `time`, each
    /// with the state's embedding `state` added (what the chunk moves from, read without a hop
    /// through attention).
    fn action_tokens(&self, actions_in: &Tensor, time: &Tensor, state: &Tensor) -> Tensor {
        self.linear(actions_in, &self.action_in).to_kind(Kind::Float)
            + self.time_embedding(time)
            + &self.action_pos
            + state
    }

    /// What the head reads in the chunk's place: the noised chunk and its time under flow
    /// matching; zeros at time 0 under the L1 loss (the chunk regressed from the prefix).
    fn chunk_input(&self, episode: &EpisodeInputs) -> (Tensor, Tensor) {
        match self.action_loss {
            ActionLoss::Flow => {
                let t = episode.time.view([-1, 1, 1]);
                (&episode.noise * (1.0 - &t) + &episode.actions * &t, episode.time.shallow_clone())
            }
            ActionLoss::L1 => (episode.actions.zeros_like(), episode.time.zeros_like()),
        }
    }

    /// The sequence `[batch, seq, d]` fp32 with the chunk's tokens made from `chunk_in` at `time`.
    fn sequence(&self, inputs: &Inputs, chunk_in: &Tensor, time: &Tensor) -> Tensor {
        let episode = Self::episode(inputs);
        // Padding's positions hold zeros, so the instruction's positions sum to its tokens alone.
        let text = embed(&self.wte, &self.wpe, &inputs.tokens) * episode.token_mask.unsqueeze(-1);
        let state = self.state_embedding(episode);
        let chunk = self.action_tokens(chunk_in, time, &state);
        Tensor::cat(&[self.patches(&episode.frames), text, state, chunk], 1)
    }

    /// Self-attention over `h` `[rows, seq, d]`; `masked`: under the backbone's prefix mask.
    fn attention(&self, block: &BlockParams, h: &Tensor, masked: bool) -> Tensor {
        let (rows, seq, d) = h.size3().expect("activations are [rows, seq, d]");
        let n_head = self.shape.base.n_head as i64;
        let qkv = self.linear(h, &block.attn);
        let parts = qkv.split(d, 2);
        let heads = |t: &Tensor| t.view([rows, seq, n_head, d / n_head]).transpose(1, 2);
        let (q, k, v) = (heads(&parts[0]), heads(&parts[1]), heads(&parts[2]));
        let y = if self.math_attention[usize::from(masked)] {
            // Scores and the weighted sum as batched matrix multiplies in the compute type: the
            // scale on the queries (a sixth of the scores' size at these lengths), the mask added
            // as 0 or -inf, libtorch's softmax (which accumulates 16-bit rows in fp32).
            let scale = 1.0 / ((d / n_head) as f64).sqrt();
            let scores = self.products.matmul(&(q * scale), &k.transpose(-2, -1));
            let scores = if masked { scores + &self.backbone_bias } else { scores };
            let kind = scores.kind();
            self.products.matmul(&scores.softmax(-1, kind), &v)
        } else {
            // The mask as 0 or -inf in the compute type, which the kernel adds as it is.
            let mask = masked.then_some(&self.backbone_bias);
            Tensor::scaled_dot_product_attention(&q, &k, &v, mask, 0.0, false, None, false)
        };
        self.linear(&y.transpose(1, 2).contiguous().view([rows, seq, d]), &block.attn_proj)
    }

    fn mlp(&self, block: &BlockParams, h: &Tensor) -> Tensor {
        self.linear(&self.linear(h, &block.fc).gelu("none"), &block.mlp_proj)
    }

    /// The head's prediction for the chunk: `[batch, chunk, action_dim]` fp32.
    fn predict(&self, x: &Tensor) -> Tensor {
        let (seq, chunk) = (self.shape.base.seq_len as i64, self.shape.chunk as i64);
        let h = self.layer_norm(&x.narrow(1, seq - chunk, chunk), &self.ln_f);
        self.linear(&h, &self.action_out).to_kind(Kind::Float)
    }

    fn trunk(&self, x: Tensor) -> Tensor {
        self.blocks_in(0..self.shape.base.n_layer, x)
    }

    /// `x` through blocks `layers`, both residual branches each.
    fn blocks_in(&self, layers: std::ops::Range<usize>, x: Tensor) -> Tensor {
        let mut x = x;
        for layer_idx in layers {
            x = self.residual(layer_idx, Branch::Attention, &x);
            x = self.residual(layer_idx, Branch::Mlp, &x);
        }
        x
    }

    /// `per_value` `[batch, chunk, action_dim]` summed over the actions that exist, over the
    /// values a full chunk holds (`batch x chunk x action_dim`): a mean in which a missing action
    /// counts as no error. Dividing by the present count instead would make the loss of a batch
    /// split over ranks differ from the whole batch's (ranks hold different counts).
    fn masked_mean(&self, per_value: &Tensor, mask: &Tensor) -> Tensor {
        let values = per_value.numel() as f64;
        (per_value * mask.unsqueeze(-1)).sum(Kind::Float) / values
    }

    /// The instruction's next-token cross-entropy: positions 0..n-1 of the instruction read
    /// through the final norm and the token embedding's rows predict `inputs.targets`, summed over
    /// the present targets (not -100), over the batch's possible targets (`batch x (n - 1)`).
    fn instruction_loss(&self, x: &Tensor, inputs: &Inputs) -> Tensor {
        let (vision, n) = (self.shape.vision_tokens() as i64, self.shape.instruction_tokens as i64);
        let h = self.layer_norm(&x.narrow(1, vision, n - 1), &self.ln_f);
        let logits = if self.compute == Kind::Float {
            h.linear::<Tensor>(&self.wte, None)
        } else {
            h.to_kind(self.compute).linear::<Tensor>(&self.wte.to_kind(self.compute), None)
        };
        let vocab = self.shape.base.vocab_size as i64;
        let targets = inputs.targets.reshape([-1]);
        let summed = logits.to_kind(Kind::Float).reshape([-1, vocab]).cross_entropy_loss::<Tensor>(
            &targets,
            None,
            tch::Reduction::Sum,
            -100,
            0.0,
        );
        summed / targets.size()[0] as f64
    }

    fn head_loss(&self, x: &Tensor, inputs: &Inputs) -> Tensor {
        let actions = self.action_loss(x, inputs);
        if self.instruction_lm > 0.0 {
            actions + self.instruction_loss(x, inputs) * self.instruction_lm
        } else {
            actions
        }
    }

    fn action_loss(&self, x: &Tensor, inputs: &Inputs) -> Tensor {
        let episode = Self::episode(inputs);
        let predicted = self.predict(x);
        match self.action_loss {
            ActionLoss::Flow => {
                let velocity = &episode.actions - &episode.noise;
                self.masked_mean(&(predicted - velocity).square(), &episode.action_mask)
            }
            ActionLoss::L1 => self.masked_mean(&(predicted - &episode.actions).abs(), &episode.action_mask),
        }
    }

    /// The action chunk the model gives for the sample: the flow integrated from the sample's
    /// noise by `flow_steps` Euler steps (under L1, one prediction). `[batch, chunk, action_dim]`.
    pub fn act(&self, inputs: &Inputs) -> Tensor {
        let episode = Self::episode(inputs);
        match self.action_loss {
            ActionLoss::L1 => {
                let (chunk_in, time) = self.chunk_input(episode);
                self.predict(&self.trunk(self.sequence(inputs, &chunk_in, &time)))
            }
            ActionLoss::Flow => {
                let (steps, tower) = (self.shape.flow_steps, self.shape.vision_layers);
                let prefix = (self.shape.base.seq_len - self.shape.chunk) as i64;
                let mut actions = episode.noise.shallow_clone();
                // The prefix's embedding and the vision tower's output do not depend on the chunk
                // (the tower passes it through), so they are computed once; each Euler step puts
                // the chunk's new tokens after them and runs the backbone.
                let first = self.blocks_in(0..tower, self.sequence(inputs, &actions, &episode.time.zeros_like()));
                let seen = first.narrow(1, 0, prefix);
                let state = self.state_embedding(episode);
                let mut x = first;
                for step in 0..steps {
                    if step > 0 {
                        let time = episode.time.full_like(step as f64 / steps as f64);
                        x = Tensor::cat(&[&seen, &self.action_tokens(&actions, &time, &state)], 1);
                    }
                    let velocity = self.predict(&self.blocks_in(tower..self.shape.base.n_layer, x.shallow_clone()));
                    actions = actions + velocity / steps as f64;
                }
                actions
            }
        }
    }
}

impl Model for Vla {
    fn shape(&self) -> GptShape {
        self.shape.base
    }

    fn params(&self) -> &FlatParams {
        &self.params
    }

    fn params_mut(&mut self) -> &mut FlatParams {
        &mut self.params
    }

    fn n_params(&self) -> usize {
        self.shape.n_params()
    }

    /// Per position of the sequence: a sample's training FLOPs (the vision tower counted over
    /// the vision tokens it reads) over its length, so tokens/s times this is the model's FLOP rate.
    fn flops_per_token(&self) -> f64 {
        self.shape.flops_per_sample() / self.shape.base.seq_len as f64
    }

    fn widened_products(&self) -> bool {
        self.products.widened()
    }

    fn embed(&self, inputs: &Inputs) -> Tensor {
        let (chunk_in, time) = self.chunk_input(Self::episode(inputs));
        self.sequence(inputs, &chunk_in, &time)
    }

    fn norm(&self, which: Norm, x: &Tensor) -> Tensor {
        let params = match which {
            Norm::Attention(layer_idx) => &self.blocks[layer_idx].ln_1,
            Norm::Mlp(layer_idx) => &self.blocks[layer_idx].ln_2,
            Norm::Final => &self.ln_f,
        };
        self.layer_norm(x, params)
    }

    /// A vision block's attention runs within each frame's patches (`normed` holds the vision
    /// tokens only); a backbone block's over the whole sequence under the prefix mask.
    fn branch(&self, layer_idx: usize, branch: Branch, normed: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        match branch {
            Branch::Mlp => self.mlp(block, normed),
            Branch::Attention if layer_idx < self.shape.vision_layers => {
                let (batch, _, d) = normed.size3().expect("activations are [batch, seq, d]");
                let per_frame = self.shape.patches_per_frame() as i64;
                let frames = normed.view([batch * self.shape.frames as i64, per_frame, d]);
                self.attention(block, &frames, false).view([batch, -1, d])
            }
            Branch::Attention => self.attention(block, normed, true),
        }
    }

    /// A vision block's branches act on the vision tokens and pass the rest through; the first
    /// backbone block projects the vision tokens before its attention.
    fn residual(&self, layer_idx: usize, branch: Branch, x: &Tensor) -> Tensor {
        let vision = self.shape.vision_tokens() as i64;
        let rest = self.shape.base.seq_len as i64 - vision;
        let norm = Norm::before(layer_idx, branch);
        // The stream is cut by `split_with_sizes`, not `narrow`: the backward of a split joins
        // the pieces' gradients in one copy, where each narrow's would write a zeroed gradient of
        // the whole stream and autograd would add them.
        if layer_idx < self.shape.vision_layers {
            let parts = x.split_with_sizes([vision, rest], 1);
            let (v, rest) = (&parts[0], &parts[1]);
            let v = if branch == Branch::Attention { self.film(layer_idx, rest, v) } else { v.shallow_clone() };
            let v = &v + self.branch(layer_idx, branch, &self.norm(norm, &v));
            return Tensor::cat(&[&v, rest], 1);
        }
        let x = if layer_idx == self.shape.vision_layers && branch == Branch::Attention {
            self.project_tower(x)
        } else {
            x.shallow_clone()
        };
        &x + self.branch(layer_idx, branch, &self.norm(norm, &x))
    }

    fn blocks_by_hand(&self) -> bool {
        self.runs_blocks_by_hand()
    }

    fn block_by_hand<'m>(&'m self, layer_idx: usize, x: &Tensor) -> Option<(Tensor, Box<dyn BlockBackward + 'm>)> {
        self.block_forward_by_hand(layer_idx, x)
    }

    fn head_loss_for_backward(&self, x: &Tensor, normed: bool, inputs: &Inputs, _loss_multiplier: f64) -> HeadLoss<'_> {
        debug_assert!(!normed, "vla runs no norm by hand");
        HeadLoss { loss: self.head_loss(x, inputs), by_hand: None }
    }

    fn loss(&self, inputs: &Inputs) -> Tensor {
        self.head_loss(&self.trunk(self.embed(inputs)), inputs)
    }

    /// The squared error of the chunk [`Vla::act`] gives, over the actions that exist, divided
    /// by the values of full chunks.
    fn eval_loss(&self, inputs: &Inputs) -> Tensor {
        let episode = Self::episode(inputs);
        self.masked_mean(&(self.act(inputs) - &episode.actions).square(), &episode.action_mask)
    }

    /// No token logits: the head predicts actions.
    fn forward(&self, _inputs: &Tensor) -> Option<Tensor> {
        None
    }
}

mod by_hand;
#[cfg(test)]
mod tests;
