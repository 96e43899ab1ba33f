//! `[model]`: which family and what shape, plain data.

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// `[model]`: the model's family and shape. Sizes left at 0 come from the preset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The kind of model: "gpt" (nanoGPT's GPT-2: LayerNorm, biases), "gpt-rms" (the same
    /// decoder with RMSNorm and no biases) or "llama" (RMSNorm, rotary positions, SwiGLU MLP,
    /// grouped-query attention, Hugging Face's parameter names). gpt-rms and llama run every op in
    /// libtorch's graph, so the `train.fused_*` kernels do not apply to them. Default "gpt".
    pub family: String,
    /// Named shape: "tiny" (4 layers, d 256), "small" (6 layers, d 384), "gpt2-124m", and for
    /// llama also "llama-tiny" (4 layers, d 256, 2 key/value heads), "llama3-8b", "llama3-70b".
    /// Default "tiny".
    pub preset: String,
    /// Transformer blocks; 0 takes the preset's. Default 0.
    pub n_layer: usize,
    /// Attention heads; 0 takes the preset's. Default 0.
    pub n_head: usize,
    /// Model width; 0 takes the preset's. Default 0.
    pub d_model: usize,
    /// Context length in tokens; 0 takes the preset's. Default 0.
    pub seq_len: usize,
    /// Vocabulary size; 0 takes the preset's (256 byte tokens for tiny and small). Default 0.
    pub vocab_size: usize,
    /// The GELU of the gpt families' MLP: "exact" (erf, nanoGPT's) or "tanh" (the tanh
    /// approximation, GPT-2's own `gelu_new`, which imported GPT-2 checkpoints need; the fused
    /// bias-GELU kernel computes the exact one, so "tanh" runs libtorch's). Default "exact".
    pub gelu: String,
    /// Key/value heads of grouped-query attention (llama only); 0 takes the preset's (every head
    /// when the preset has no grouping). Must divide `n_head`. Default 0.
    pub n_kv_head: usize,
    /// Hidden width of the SwiGLU MLP (llama only); 0 takes the preset's, or Llama's rule (8d/3
    /// rounded up to a multiple of 256) for a preset without one. Default 0.
    pub ffn_hidden: usize,
    /// Base of the rotary embedding's frequencies (llama only); 0 takes the preset's (500000 for
    /// the Llama 3 shapes, 10000 otherwise). Default 0.
    pub rope_theta: f64,
    /// The RMSNorm's epsilon (llama only); 0 takes 1e-5, Llama 3's. Default 0.
    pub norm_eps: f64,
    /// The head shares the token embedding's matrix (llama only: Llama 3.2 1B and 3B tie it,
    /// 8B and 70B do not; the gpt families always tie). Default false.
    pub tie_head: bool,
    /// Llama 3.1's long-context rescaling of the rotary frequencies (llama only): "none" or
    /// "llama3" with the factors below. Default "none".
    pub rope_scaling: String,
    /// With `rope_scaling = "llama3"`: how much longer the context is than the one trained on. Default 8.
    pub rope_factor: f64,
    /// With `rope_scaling = "llama3"`: wavelengths above original context / this are divided by
    /// `rope_factor`. Default 1.
    pub rope_low_freq_factor: f64,
    /// With `rope_scaling = "llama3"`: wavelengths below original context / this are kept. Default 4.
    pub rope_high_freq_factor: f64,
    /// With `rope_scaling = "llama3"`: the context the frequencies were trained for. Default 8192.
    pub rope_original_context: usize,
    /// Vision transformer blocks before the backbone (vla only); 0 takes the preset's. Default 0.
    pub vision_layers: usize,
    /// Side in pixels of the square patches a frame is cut into (vla only); 0 takes the
    /// preset's. Default 0.
    pub patch: usize,
    /// Side in pixels of the frames the model reads, the loader's output (vla only); 0 takes the
    /// preset's. Default 0.
    pub image_side: usize,
    /// Frames per sample, cameras x (history + 1) (vla only); 0 takes the dataset's. Default 0.
    pub frames: usize,
    /// Width of the robot's state vector (vla only); 0 takes the dataset's. Default 0.
    pub state_dim: usize,
    /// Width of one action (vla only); 0 takes the dataset's. Default 0.
    pub action_dim: usize,
    /// Future actions predicted per sample, the action chunk (vla only); 0 takes the preset's.
    /// Default 0.
    pub chunk: usize,
    /// Instruction tokens per sample, longer ones cut, shorter ones padded (vla only); 0 takes the
    /// preset's. Default 0.
    pub instruction_tokens: usize,
    /// Euler steps that integrate the action flow at evaluation (vla only). Default 10.
    pub flow_steps: usize,
    /// Weights to start from instead of a random init: "" (none) or "hf:DIR", a Hugging Face
    /// checkpoint folder (`config.json` and `*.safetensors`, GPT-2 or Llama). The shape keys are
    /// then read from its config.json when the run starts. Default "".
    pub from: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            family: "gpt".into(),
            preset: "tiny".into(),
            n_layer: 0,
            n_head: 0,
            d_model: 0,
            seq_len: 0,
            vocab_size: 0,
            gelu: "exact".into(),
            n_kv_head: 0,
            ffn_hidden: 0,
            rope_theta: 0.0,
            norm_eps: 0.0,
            tie_head: false,
            rope_scaling: "none".into(),
            rope_factor: 8.0,
            rope_low_freq_factor: 1.0,
            rope_high_freq_factor: 4.0,
            rope_original_context: 8192,
            vision_layers: 0,
            patch: 0,
            image_side: 0,
            frames: 0,
            state_dim: 0,
            action_dim: 0,
            chunk: 0,
            instruction_tokens: 0,
            flow_steps: 10,
            from: String::new(),
        }
    }
}

/// The resolved shape of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptShape {
    pub n_layer: usize,
    pub n_head: usize,
    pub d_model: usize,
    pub seq_len: usize,
    pub vocab_size: usize,
}

impl GptShape {
    /// Parameters, counting the tied embedding once.
    pub fn n_params(&self) -> usize {
        let d = self.d_model;
        let per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        self.vocab_size * d + self.seq_len * d + self.n_layer * per_block + 2 * d
    }

    /// Training FLOPs per token: 6N for the matrix multiplies plus 12·L·d·T for attention
    /// (PaLM, appendix B), with N excluding the position embedding.
    pub fn flops_per_token(&self) -> f64 {
        let n = (self.n_params() - self.seq_len * self.d_model) as f64;
        6.0 * n + 12.0 * (self.n_layer * self.d_model * self.seq_len) as f64
    }
}

/// What the llama family adds to a [`GptShape`], resolved from the preset and `[model]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LlamaShape {
    pub base: GptShape,
    /// Key/value heads; divides `base.n_head`.
    pub n_kv_head: usize,
    /// Hidden width of the SwiGLU MLP.
    pub ffn_hidden: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub tie_head: bool,
    /// Llama 3.1's rescaling of the rotary frequencies, when on.
    pub rope_scaling: Option<RopeScaling>,
}

/// Llama 3.1's rescaling of the rotary frequencies (`rope_scaling` of type "llama3" in a Hugging
/// Face config.json).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_context: usize,
}

impl LlamaShape {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.base.d_model / self.base.n_head
    }

    /// Width of the key and of the value projection.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim()
    }

    /// Parameters, counting a tied head once.
    pub fn n_params(&self) -> usize {
        let (d, v) = (self.base.d_model, self.base.vocab_size);
        let per_block = 2 * d + d * d + 2 * self.kv_dim() * d + d * d + 3 * d * self.ffn_hidden;
        let head = if self.tie_head { 0 } else { v * d };
        v * d + self.base.n_layer * per_block + d + head
    }
}

/// The vla family's resolved shape: a vision tower, a projector and a backbone over [frame
/// patches, instruction tokens, the state, the action chunk], an action head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VlaShape {
    /// `n_layer` the vision blocks and the backbone's together (the executor's blocks),
    /// `seq_len` the whole sequence, `vocab_size` the instruction's tokens.
    pub base: GptShape,
    pub vision_layers: usize,
    pub patch: usize,
    pub image_side: usize,
    pub frames: usize,
    pub state_dim: usize,
    pub action_dim: usize,
    pub chunk: usize,
    pub instruction_tokens: usize,
    pub flow_steps: usize,
}

impl VlaShape {
    /// Patches of one frame.
    pub fn patches_per_frame(&self) -> usize {
        (self.image_side / self.patch).pow(2)
    }

    /// The vision tokens of a sample: every frame's patches.
    pub fn vision_tokens(&self) -> usize {
        self.frames * self.patches_per_frame()
    }

    /// Values of one flattened patch (RGB).
    pub fn patch_dim(&self) -> usize {
        3 * self.patch * self.patch
    }

    /// The backbone's blocks.
    pub fn backbone_layers(&self) -> usize {
        self.base.n_layer - self.vision_layers
    }

    /// Parameters of the embedding unit: the patch projection (weight and bias), the vision
    /// positions, the token embedding and the instruction's positions, the state projection,
    /// the action projection, the flow time's two-layer MLP and the action chunk's positions.
    pub fn embedding_params(&self) -> usize {
        let d = self.base.d_model;
        (self.patch_dim() + 1) * d
            + self.vision_tokens() * d
            + self.base.vocab_size * d
            + self.instruction_tokens * d
            + (self.state_dim + 1) * d
            + (self.action_dim + 1) * d
            + 2 * (d * d + d)
            + self.chunk * d
    }

    /// Parameters of one block (the GPT's: LayerNorms, attention and a 4d MLP, with biases).
    pub fn block_params(&self) -> usize {
        let d = self.base.d_model;
        2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    }

    /// Parameters of the projector from the vision tower into the backbone and of the keypoint
    /// readout beside it (in the first backbone block's unit): the projector, the
    /// [`VLA_KEYPOINTS`] maps' logits, and the layer from each frame's keypoints to the chunk's width.
    pub fn projector_params(&self) -> usize {
        let (d, k) = (self.base.d_model, VLA_KEYPOINTS);
        (d * d + d) + (d * k + k) + (self.frames * 2 * k * d + d)
    }

    /// Parameters of a vision block's FiLM layer (the instruction's summary to a scale and a
    /// shift of the block's input), in that block's unit.
    pub fn film_params(&self) -> usize {
        let d = self.base.d_model;
        2 * d * d + 2 * d
    }

    /// Parameters of the head unit: the final LayerNorm and the action projection.
    pub fn head_params(&self) -> usize {
        2 * self.base.d_model + (self.base.d_model + 1) * self.action_dim
    }

    pub fn n_params(&self) -> usize {
        self.embedding_params()
            + self.base.n_layer * self.block_params()
            + self.vision_layers * self.film_params()
            + self.projector_params()
            + self.head_params()
    }

    /// Training FLOPs of one sample, forward and backward: 6 per weight per token that meets it
    /// (a vision block's weights meet the vision tokens, a backbone block's the whole sequence,
    /// the patch projection the vision tokens, the head the action chunk) plus the attention
    /// products, 12·d per pair of positions per block.
    pub fn flops_per_sample(&self) -> f64 {
        let d = self.base.d_model as f64;
        let block_matmul = (12 * self.base.d_model * self.base.d_model) as f64;
        let (vision, seq) = (self.vision_tokens() as f64, self.base.seq_len as f64);
        let per_frame = self.patches_per_frame() as f64;
        let matmul = vision * (self.patch_dim() as f64 * d + self.vision_layers as f64 * block_matmul + d * d)
            + seq * self.backbone_layers() as f64 * block_matmul
            + self.chunk as f64 * (self.action_dim as f64 * d * 2.0 + 2.0 * d * d)
            + self.vision_layers as f64 * 2.0 * d * d
            + vision * (VLA_KEYPOINTS as f64) * (d + 2.0)
            + self.frames as f64 * 2.0 * VLA_KEYPOINTS as f64 * d;
        let attention = self.vision_layers as f64 * vision * per_frame * 2.0 * d
            + self.backbone_layers() as f64 * seq * seq * 2.0 * d;
        6.0 * matmul + 3.0 * attention
    }
}

/// Keypoint maps of the vla model's spatial-softmax readout: each a softmax over a frame's
/// patches whose expected patch coordinates reach the action chunk's tokens.
pub const VLA_KEYPOINTS: usize = 32;

/// The values `model.family` takes.
pub const MODEL_FAMILIES: &[&str] = &["gpt", "gpt-rms", "llama", "vla"];

/// The families whose blocks declare their tensor-parallel split (`dist.tensor` above 1); each
/// runs sequence parallelism too (`dist.sequence_parallel`).
pub const TENSOR_PARALLEL_FAMILIES: &[&str] = &["gpt", "gpt-rms", "llama"];

/// What a vla preset fixes beyond its backbone's shape.
struct VlaPreset {
    vision_layers: usize,
    patch: usize,
    image_side: usize,
    chunk: usize,
    instruction_tokens: usize,
}

/// What a preset fixes beyond the GPT's shape (llama's keys), for the presets that fix them.
struct LlamaPreset {
    n_kv_head: usize,
    ffn_hidden: usize,
    rope_theta: f64,
}

impl ModelConfig {
    /// The names `model.preset` accepts.
    pub const PRESETS: &'static [&'static str] =
        &["tiny", "small", "gpt2-124m", "llama-tiny", "llama3-8b", "llama3-70b", "vla-tiny", "vla-small"];

    /// The resolved shape, after checking the section (`model.family` too).
    pub fn shape(&self) -> Result<GptShape, TrainError> {
        if !MODEL_FAMILIES.contains(&self.family.as_str()) {
            return Err(TrainError::InvalidConfig {
                key: "model.family",
                message: format!("must be one of {}; got {:?}", MODEL_FAMILIES.join(", "), self.family),
            });
        }
        let preset = self.preset_shape()?;
        if self.preset.starts_with("llama") && self.family != "llama" {
            return Err(TrainError::InvalidConfig {
                key: "model.preset",
                message: format!(
                    "{:?} is a llama shape; set model.family = \"llama\" (got {:?})",
                    self.preset, self.family
                ),
            });
        }
        if self.preset.starts_with("vla") != (self.family == "vla") {
            return Err(TrainError::InvalidConfig {
                key: "model.preset",
                message: format!(
                    "model.family = \"vla\" takes the presets vla-tiny and vla-small, and they take no other family; \
                     got family {:?} with preset {:?}",
                    self.family, self.preset
                ),
            });
        }
        if self.family == "vla" {
            return Ok(self.vla_shape_of(preset)?.base);
        }
        let vla_only = [
            ("model.vision_layers", self.vision_layers),
            ("model.patch", self.patch),
            ("model.image_side", self.image_side),
            ("model.frames", self.frames),
            ("model.state_dim", self.state_dim),
            ("model.action_dim", self.action_dim),
            ("model.chunk", self.chunk),
            ("model.instruction_tokens", self.instruction_tokens),
        ];
        if let Some((key, _)) = vla_only.iter().find(|(_, value)| *value != 0) {
            return Err(TrainError::InvalidConfig {
                key,
                message: format!("applies to model.family = \"vla\" only; this model is {:?}", self.family),
            });
        }
        let pick = |value: usize, preset: usize| if value == 0 { preset } else { value };
        let shape = GptShape {
            n_layer: pick(self.n_layer, preset.n_layer),
            n_head: pick(self.n_head, preset.n_head),
            d_model: pick(self.d_model, preset.d_model),
            seq_len: pick(self.seq_len, preset.seq_len),
            vocab_size: pick(self.vocab_size, preset.vocab_size),
        };
        if shape.d_model % shape.n_head != 0 {
            return Err(TrainError::InvalidConfig {
                key: "model.n_head",
                message: format!("must divide model.d_model = {}; got {}", shape.d_model, shape.n_head),
            });
        }
        if self.family != "llama" {
            let llama_only = [
                ("model.n_kv_head", self.n_kv_head != 0),
                ("model.ffn_hidden", self.ffn_hidden != 0),
                ("model.rope_theta", self.rope_theta != 0.0),
                ("model.norm_eps", self.norm_eps != 0.0),
                ("model.tie_head", self.tie_head),
                ("model.rope_scaling", self.rope_scaling != "none"),
            ];
            if let Some((key, _)) = llama_only.iter().find(|(_, set)| *set) {
                return Err(TrainError::InvalidConfig {
                    key,
                    message: format!("applies to model.family = \"llama\" only; this model is {:?}", self.family),
                });
            }
        }
        match (self.family.as_str(), self.gelu.as_str()) {
            ("llama", "exact") | ("gpt" | "gpt-rms", "exact" | "tanh") => {}
            ("llama", _) => {
                return Err(TrainError::InvalidConfig {
                    key: "model.gelu",
                    message: "applies to the gpt families only (llama's MLP is SwiGLU); leave it \"exact\"".into(),
                })
            }
            (_, other) => {
                return Err(TrainError::InvalidConfig {
                    key: "model.gelu",
                    message: format!("must be \"exact\" or \"tanh\"; got {other:?}"),
                })
            }
        }
        if self.family == "llama" {
            self.llama_shape_of(shape)?;
        }
        Ok(shape)
    }

    /// The preset's shape (for the vla presets their backbone's, the sequence resolved later).
    fn preset_shape(&self) -> Result<GptShape, TrainError> {
        Ok(match self.preset.as_str() {
            "tiny" => GptShape { n_layer: 4, n_head: 4, d_model: 256, seq_len: 128, vocab_size: 256 },
            "small" => GptShape { n_layer: 6, n_head: 6, d_model: 384, seq_len: 256, vocab_size: 256 },
            "gpt2-124m" => GptShape { n_layer: 12, n_head: 12, d_model: 768, seq_len: 1024, vocab_size: 50304 },
            "llama-tiny" => GptShape { n_layer: 4, n_head: 4, d_model: 256, seq_len: 128, vocab_size: 256 },
            // Meta's Llama 3 8B and 70B (their params.json and Hugging Face config.json).
            "llama3-8b" => GptShape { n_layer: 32, n_head: 32, d_model: 4096, seq_len: 8192, vocab_size: 128256 },
            "llama3-70b" => GptShape { n_layer: 80, n_head: 64, d_model: 8192, seq_len: 8192, vocab_size: 128256 },
            // The backbones of the vla presets (their seq_len is the whole sequence, resolved by vla_shape_of).
            "vla-tiny" => GptShape { n_layer: 4, n_head: 4, d_model: 128, seq_len: 0, vocab_size: 256 },
            "vla-small" => GptShape { n_layer: 6, n_head: 6, d_model: 384, seq_len: 0, vocab_size: 256 },
            other => {
                return Err(TrainError::InvalidConfig {
                    key: "model.preset",
                    message: format!("must be one of {}; got {other:?}", ModelConfig::PRESETS.join(", ")),
                })
            }
        })
    }

    /// The vla family's resolved shape (see [`ModelConfig::shape`] for the checks).
    pub fn vla_shape(&self) -> Result<VlaShape, TrainError> {
        self.shape()?;
        self.vla_shape_of(self.preset_shape()?)
    }

    fn vla_shape_of(&self, backbone: GptShape) -> Result<VlaShape, TrainError> {
        let invalid = |key, message: String| Err(TrainError::InvalidConfig { key, message });
        let preset = match self.preset.as_str() {
            "vla-tiny" => VlaPreset { vision_layers: 2, patch: 8, image_side: 64, chunk: 8, instruction_tokens: 32 },
            _ => VlaPreset { vision_layers: 4, patch: 16, image_side: 224, chunk: 16, instruction_tokens: 32 },
        };
        let others = [
            ("model.seq_len", self.seq_len != 0),
            ("model.gelu", self.gelu != "exact"),
            ("model.n_kv_head", self.n_kv_head != 0),
            ("model.ffn_hidden", self.ffn_hidden != 0),
            ("model.rope_theta", self.rope_theta != 0.0),
            ("model.norm_eps", self.norm_eps != 0.0),
            ("model.tie_head", self.tie_head),
            ("model.rope_scaling", self.rope_scaling != "none"),
            ("model.from", !self.from.is_empty()),
        ];
        if let Some((key, _)) = others.iter().find(|(_, set)| *set) {
            return invalid(
                key,
                "does not apply to model.family = \"vla\" (its sequence is set by the vla keys)".into(),
            );
        }
        let pick = |value: usize, preset: usize| if value == 0 { preset } else { value };
        let (patch, image_side) = (pick(self.patch, preset.patch), pick(self.image_side, preset.image_side));
        if image_side % patch != 0 {
            return invalid("model.patch", format!("must divide model.image_side = {image_side}; got {patch}"));
        }
        let unresolved =
            [("model.frames", self.frames), ("model.state_dim", self.state_dim), ("model.action_dim", self.action_dim)];
        if let Some((key, _)) = unresolved.iter().find(|(_, value)| *value == 0) {
            return invalid(
                key,
                "is 0 and no episodes dataset gave it: train on a folder from `stoke prep episodes` (data.path) or set it".into(),
            );
        }
        if self.flow_steps == 0 {
            return invalid("model.flow_steps", "must be at least 1".into());
        }
        let (d_model, n_head) = (pick(self.d_model, backbone.d_model), pick(self.n_head, backbone.n_head));
        if d_model % n_head != 0 {
            return invalid("model.n_head", format!("must divide model.d_model = {d_model}; got {n_head}"));
        }
        let vision_layers = pick(self.vision_layers, preset.vision_layers);
        let mut shape = VlaShape {
            base: GptShape {
                n_layer: vision_layers + pick(self.n_layer, backbone.n_layer),
                n_head,
                d_model,
                seq_len: 0,
                vocab_size: pick(self.vocab_size, backbone.vocab_size),
            },
            vision_layers,
            patch,
            image_side,
            frames: self.frames,
            state_dim: self.state_dim,
            action_dim: self.action_dim,
            chunk: pick(self.chunk, preset.chunk),
            instruction_tokens: pick(self.instruction_tokens, preset.instruction_tokens),
            flow_steps: self.flow_steps,
        };
        shape.base.seq_len = shape.vision_tokens() + shape.instruction_tokens + 1 + shape.chunk;
        Ok(shape)
    }

    /// The llama family's resolved shape (see [`ModelConfig::shape`] for the checks).
    pub fn llama_shape(&self) -> Result<LlamaShape, TrainError> {
        let base = self.shape()?;
        self.llama_shape_of(base)
    }

    fn llama_shape_of(&self, base: GptShape) -> Result<LlamaShape, TrainError> {
        let preset = match self.preset.as_str() {
            "llama-tiny" => Some(LlamaPreset { n_kv_head: 2, ffn_hidden: 768, rope_theta: 10000.0 }),
            "llama3-8b" => Some(LlamaPreset { n_kv_head: 8, ffn_hidden: 14336, rope_theta: 500000.0 }),
            "llama3-70b" => Some(LlamaPreset { n_kv_head: 8, ffn_hidden: 28672, rope_theta: 500000.0 }),
            _ => None,
        };
        // A preset's key/value heads hold only for its own head count.
        let preset_kv = preset.as_ref().filter(|_| self.n_head == 0).map_or(base.n_head, |p| p.n_kv_head);
        let n_kv_head = if self.n_kv_head == 0 { preset_kv } else { self.n_kv_head };
        // Llama's rule: two thirds of 4d, rounded up to a multiple of 256.
        let llama_rule = (8 * base.d_model / 3).div_ceil(256) * 256;
        let preset_ffn = preset.as_ref().filter(|_| self.d_model == 0).map_or(llama_rule, |p| p.ffn_hidden);
        let ffn_hidden = if self.ffn_hidden == 0 { preset_ffn } else { self.ffn_hidden };
        let rope_theta =
            if self.rope_theta != 0.0 { self.rope_theta } else { preset.as_ref().map_or(10000.0, |p| p.rope_theta) };
        if n_kv_head == 0 || base.n_head % n_kv_head != 0 {
            return Err(TrainError::InvalidConfig {
                key: "model.n_kv_head",
                message: format!("must divide model.n_head = {}; got {n_kv_head}", base.n_head),
            });
        }
        if (base.d_model / base.n_head) % 2 != 0 {
            return Err(TrainError::InvalidConfig {
                key: "model.n_head",
                message: format!(
                    "must leave an even head width for the rotary embedding; d_model {} / n_head {} is odd",
                    base.d_model, base.n_head
                ),
            });
        }
        if !(rope_theta > 1.0) || self.norm_eps < 0.0 {
            let key = if self.norm_eps < 0.0 { "model.norm_eps" } else { "model.rope_theta" };
            return Err(TrainError::InvalidConfig { key, message: "out of range".into() });
        }
        let rope_scaling = match self.rope_scaling.as_str() {
            "none" => None,
            "llama3" => {
                if !(self.rope_factor >= 1.0 && self.rope_high_freq_factor > self.rope_low_freq_factor)
                    || self.rope_low_freq_factor <= 0.0
                    || self.rope_original_context == 0
                {
                    return Err(TrainError::InvalidConfig {
                        key: "model.rope_scaling",
                        message: "\"llama3\" needs rope_factor >= 1, 0 < rope_low_freq_factor < \
                                  rope_high_freq_factor and rope_original_context > 0"
                            .into(),
                    });
                }
                Some(RopeScaling {
                    factor: self.rope_factor,
                    low_freq_factor: self.rope_low_freq_factor,
                    high_freq_factor: self.rope_high_freq_factor,
                    original_context: self.rope_original_context,
                })
            }
            other => {
                return Err(TrainError::InvalidConfig {
                    key: "model.rope_scaling",
                    message: format!("must be \"none\" or \"llama3\"; got {other:?}"),
                })
            }
        };
        let norm_eps = if self.norm_eps == 0.0 { 1e-5 } else { self.norm_eps };
        Ok(LlamaShape { base, n_kv_head, ffn_hidden, rope_theta, norm_eps, tie_head: self.tie_head, rope_scaling })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_shape_has_124m_parameters() {
        let cfg = ModelConfig { preset: "gpt2-124m".into(), vocab_size: 50257, ..ModelConfig::default() };
        let n = cfg.shape().unwrap().n_params();
        assert_eq!(n, 124_439_808, "nanoGPT reports 124.44M with the position embedding");
    }

    #[test]
    fn bad_head_count_names_the_key() {
        let cfg = ModelConfig { n_head: 5, ..ModelConfig::default() };
        let err = cfg.shape().unwrap_err().to_string();
        assert!(err.contains("model.n_head"), "{err}");
    }

    #[test]
    fn unknown_family_names_the_key_and_the_families() {
        let cfg = ModelConfig { family: "mamba".into(), ..ModelConfig::default() };
        let err = cfg.shape().unwrap_err().to_string();
        assert!(
            err.contains("model.family") && err.contains("gpt, gpt-rms, llama") && err.contains("\"mamba\""),
            "{err}"
        );
    }

    /// Llama 3 8B holds 8.03 billion parameters and 70B 70.55 billion (Meta's model cards).
    #[test]
    fn llama3_presets_have_the_published_parameter_counts() {
        let count = |preset: &str| {
            let cfg = ModelConfig { family: "llama".into(), preset: preset.into(), ..ModelConfig::default() };
            cfg.llama_shape().unwrap().n_params()
        };
        assert_eq!(count("llama3-8b"), 8_030_261_248);
        assert_eq!(count("llama3-70b"), 70_553_706_496);
    }

    #[test]
    fn llama_keys_are_refused_elsewhere_and_checked() {
        let gpt = ModelConfig { n_kv_head: 2, ..ModelConfig::default() };
        assert!(gpt.shape().unwrap_err().to_string().contains("model.n_kv_head"));
        let bad = ModelConfig { family: "llama".into(), n_kv_head: 3, ..ModelConfig::default() };
        assert!(bad.shape().unwrap_err().to_string().contains("model.n_kv_head"));
        let tiny = ModelConfig { family: "llama".into(), preset: "llama-tiny".into(), ..ModelConfig::default() };
        let shape = tiny.llama_shape().unwrap();
        assert_eq!((shape.n_kv_head, shape.ffn_hidden, shape.tie_head), (2, 768, false));
        let regrouped = ModelConfig { n_head: 8, ..tiny };
        assert_eq!(regrouped.llama_shape().unwrap().n_kv_head, 8, "a preset's grouping is for its own heads");
    }
}
