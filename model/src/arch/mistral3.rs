//! Mistral 3 (GGUF arch `mistral3`: Mistral Small 3.1/3.2 24B, Ministral 3 as llama.cpp
//! converts them): the Llama block, with Mistral's sliding-window attention where the file sets
//! `attention.sliding_window` (as `llama` files may). Ministral 3's YaRN RoPE and its Llama 4
//! attention temperature (`attention.temperature_scale`) are not implemented: such a file is
//! refused by name rather than run wrong.

use super::{llama, Hparams, MetaKey};
use crate::error::ModelError;
use crate::gguf::Metadata;

/// Mistral 3's rules: Llama's, and a refusal of what we do not run.
pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    let a = hp.arch.name();
    let bad = |why: String| {
        Err(ModelError::BadHparams {
            arch: hp.arch.name(),
            why,
        })
    };
    if let Some(t) = md.opt_f32(&MetaKey::AttnTemperatureScale.of(a))? {
        if t != 0.0 {
            return bad(format!(
                "{} = {t}: Llama 4 attention temperature scaling is not supported",
                MetaKey::AttnTemperatureScale.of(a)
            ));
        }
    }
    if let Some(kind) = md.opt_str(&MetaKey::RopeScalingType.of(a))? {
        if !matches!(kind, "none" | "linear") {
            return bad(format!(
                "{} = {kind}: only linear RoPE scaling is supported",
                MetaKey::RopeScalingType.of(a)
            ));
        }
    }
    llama::apply(hp, md)
}
