//! A vla model's input sizes from its episodes, filled into `[model]` when the config loads (a leaf:
//! the config's loader calls it, so it takes the data keys as plain values).

use std::path::Path;

use stoke_data::read_episode_manifest;
use stoke_train::ModelConfig;

/// Cameras, state width and action width of the built-in robot set (`data.path = ""`).
pub const BUILTIN_DIMS: (usize, usize, usize) = (1, 2, 2);

/// The `[data]` keys the model's input sizes depend on.
pub struct EpisodeData<'a> {
    pub path: &'a str,
    pub history: usize,
    pub blank: &'a str,
}

/// `model` with `frames`, `state_dim` and `action_dim` taken from the episodes `data` names when
/// 0, and checked against them when set. Other families pass unchanged. Errors: (key, message).
pub fn resolve_episode_dims(
    model: &ModelConfig,
    data: &EpisodeData<'_>,
) -> Result<ModelConfig, (&'static str, String)> {
    if !["none", "frames", "instructions"].contains(&data.blank) {
        return Err(("data.blank", format!("must be \"none\", \"frames\" or \"instructions\"; got {:?}", data.blank)));
    }
    if model.family != "vla" {
        if data.blank != "none" || data.history != 0 {
            let key = if data.history != 0 { "data.history" } else { "data.blank" };
            return Err((
                key,
                format!("applies to robot episodes (model.family = \"vla\"); this model is {:?}", model.family),
            ));
        }
        return Ok(model.clone());
    }
    let (cameras, state_dim, action_dim) = if data.path.is_empty() {
        BUILTIN_DIMS
    } else {
        let manifest = read_episode_manifest(Path::new(data.path)).map_err(|err| {
            ("data.path", format!("model.family = \"vla\" reads a folder from `stoke prep episodes`: {err}"))
        })?;
        (manifest.cameras.len(), manifest.state_dim, manifest.action_dim)
    };
    let mut resolved = model.clone();
    let frames = cameras * (data.history + 1);
    for (key, value, dataset) in [
        ("model.frames", &mut resolved.frames, frames),
        ("model.state_dim", &mut resolved.state_dim, state_dim),
        ("model.action_dim", &mut resolved.action_dim, action_dim),
    ] {
        if *value == 0 {
            *value = dataset;
        } else if *value != dataset {
            return Err((key, format!("is {value}, but the episodes in data.path give {dataset}")));
        }
    }
    Ok(resolved)
}
