//! A run's model as a Hugging Face folder: `config.json` and `model.safetensors` that
//! transformers' `from_pretrained` loads into `GPT2LMHeadModel` or `LlamaForCausalLM`.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use stoke_ckpt::{DType, TensorRecord};

use super::{config, conv1d, error};
use crate::config::ModelConfig;
use crate::TrainError;

/// Writes fp32 `tensors` (name, shape, little-endian bytes) as one safetensors file at `path`,
/// saying it was written for PyTorch (transformers and peft check that).
pub(crate) fn write_safetensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a str, &'a [usize], &'a [u8])>,
) -> Result<(), TrainError> {
    let mut views = Vec::new();
    for (name, shape, data) in tensors {
        let view = TensorView::new(Dtype::F32, shape.to_vec(), data).map_err(|e| TrainError::HfTensor {
            path: path.to_path_buf(),
            tensor: name.into(),
            message: e.to_string(),
        })?;
        views.push((name, view));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| error(path, format!("cannot write: {e}")))
}

/// `[rows, cols]` fp32 little-endian bytes transposed to `[cols, rows]`.
fn transposed(data: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            let from = 4 * (r * cols + c);
            let to = 4 * (c * rows + r);
            out[to..to + 4].copy_from_slice(&data[from..from + 4]);
        }
    }
    out
}

/// Writes `config.json` and `model.safetensors` for the model `model` describes with the
/// parameters `tensors` (a checkpoint's model file: fp32, stoke's names) into the folder `out`
/// (made when missing). GPT-2's `Conv1D` matrices are written `[in, out]`; a tied head is left
/// out, as `save_pretrained` leaves it. Returns the bytes of the tensor file.
pub fn export_hf(model: &ModelConfig, tensors: &[TensorRecord], out: &Path) -> Result<u64, TrainError> {
    let json = config::config_json(model)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrainError::Io { path, source }
    };
    let mut prepared: Vec<(String, Vec<usize>, Cow<[u8]>)> = Vec::with_capacity(tensors.len());
    for record in tensors {
        if record.dtype != DType::F32 {
            return Err(TrainError::HfTensor {
                path: out.to_path_buf(),
                tensor: record.name.clone(),
                message: format!("is {:?}; a checkpoint's model is fp32", record.dtype),
            });
        }
        if conv1d(&model.family, &record.name) && record.shape.len() == 2 {
            let (rows, cols) = (record.shape[0], record.shape[1]);
            let data = transposed(&record.data, rows, cols);
            prepared.push((record.name.clone(), vec![cols, rows], Cow::Owned(data)));
        } else {
            prepared.push((record.name.clone(), record.shape.clone(), Cow::Borrowed(&record.data)));
        }
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    let file = out.join("model.safetensors");
    write_safetensors(&file, prepared.iter().map(|(name, shape, data)| (name.as_str(), shape.as_slice(), &data[..])))?;
    let text = serde_json::to_string_pretty(&json).expect("a JSON value serializes");
    let config_path = out.join("config.json");
    std::fs::write(&config_path, text + "\n").map_err(io(&config_path))?;
    Ok(std::fs::metadata(&file).map_err(io(&file))?.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transpose_moves_each_element_to_its_mirror() {
        let values: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let back: Vec<f32> =
            transposed(&bytes, 2, 3).chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(back, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    }
}
