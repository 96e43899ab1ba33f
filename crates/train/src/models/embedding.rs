//! The token and learned position embeddings that the GPT-shaped families share: the embedding unit
//! they declare first (nanoGPT's names and init) and its forward.

use tch::{Kind, Tensor};

use crate::config::GptShape;
use crate::params::{Init, ParamSpec, UnitSpec};

/// The embedding unit: `transformer.wte.weight` `[vocab, d]` and `transformer.wpe.weight`
/// `[seq_len, d]`, both N(0, `std`) with weight decay.
pub(super) fn embedding_unit(shape: GptShape, std: f64) -> UnitSpec {
    let d = shape.d_model as i64;
    let table = |name: &str, rows: usize| ParamSpec {
        name: name.into(),
        shape: vec![rows as i64, d],
        init: Init::Normal { std },
        decay: true,
    };
    UnitSpec {
        name: "embedding".into(),
        params: vec![table("transformer.wte.weight", shape.vocab_size), table("transformer.wpe.weight", shape.seq_len)],
    }
}

/// `[batch, seq, d]` fp32: the tokens' rows of `wte` plus the positions' rows of `wpe`.
pub(super) fn embed(wte: &Tensor, wpe: &Tensor, inputs: &Tensor) -> Tensor {
    with_positions(Tensor::embedding(wte, inputs, -1, false, false), wpe, inputs)
}

/// `tokens` (the token rows of `inputs`, however looked up: a cut model sums its vocabulary
/// parts) plus the positions' rows of `wpe`.
pub(super) fn with_positions(tokens: Tensor, wpe: &Tensor, inputs: &Tensor) -> Tensor {
    let positions = Tensor::arange(inputs.size()[1], (Kind::Int64, inputs.device()));
    tokens + Tensor::embedding(wpe, &positions, -1, false, false)
}
