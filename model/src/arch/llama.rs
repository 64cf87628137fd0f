//! Llama (GGUF arch `llama`, also `mistral`): Llama 2/3, SmolLM, Mistral 7B.
//!
//! The plain pre-norm block: RMSNorm → Q/K/V → interleaved RoPE → attention → output
//! projection → residual; RMSNorm → SwiGLU feed-forward → residual. These are the defaults
//! `Hparams::from_metadata` starts from. Its one rule: Mistral's sliding-window attention,
//! every layer attending to the last `attention.sliding_window` positions when the file sets
//! it (Mistral 7B v0.1: 4096; llama.cpp ignores the key for `llama` files).

use super::{Hparams, MetaKey};
use crate::error::ModelError;
use crate::gguf::Metadata;

/// Llama's rules: a sliding window on every layer where the file sets one.
pub(super) fn apply(hp: &mut Hparams, md: &Metadata) -> Result<(), ModelError> {
    let a = hp.arch.name();
    let window = md
        .opt_u32(&MetaKey::SlidingWindow.of(a))?
        .map_or(0, |v| v as usize);
    if window > 0 {
        if hp.rope_scale != 1.0 {
            // Sliding layers read the unscaled (local) RoPE table.
            return Err(ModelError::BadHparams {
                arch: hp.arch.name(),
                why: format!(
                    "{} with linear RoPE scaling is not supported",
                    MetaKey::SlidingWindow.of(a)
                ),
            });
        }
        hp.sliding_window = window;
        hp.sliding = vec![true; hp.n_layer];
        hp.rope_base_local = hp.rope_base;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::arch::{Arch, Hparams, MetaKey};
    use crate::error::ModelError;
    use crate::gguf::{GgufFile, GgufWriter, Value};

    fn hparams(arch: &str, extra: &[(MetaKey, Value)]) -> Result<Hparams, ModelError> {
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::Str(arch.into()));
        for (k, v) in [
            (MetaKey::EmbeddingLength, Value::U32(64)),
            (MetaKey::BlockCount, Value::U32(3)),
            (MetaKey::FeedForwardLength, Value::U32(128)),
            (MetaKey::HeadCount, Value::U32(4)),
            (MetaKey::RmsEpsilon, Value::F32(1e-5)),
        ]
        .into_iter()
        .chain(extra.iter().cloned())
        {
            w.add(&k.of(arch), v);
        }
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        Hparams::from_metadata(Arch::from_name(arch).unwrap(), f.metadata(), 100)
    }

    #[test]
    fn mistral_sliding_window_applies_to_every_layer_where_set() {
        let hp = hparams("llama", &[]).unwrap();
        assert!(hp.sliding.iter().all(|s| !s));
        for arch in ["llama", "mistral3"] {
            let hp = hparams(arch, &[(MetaKey::SlidingWindow, Value::U32(4096))]).unwrap();
            assert_eq!(hp.sliding, [true, true, true], "{arch}");
            assert_eq!(hp.sliding_window, 4096);
            assert_eq!(hp.rope_for_layer(0), (hp.rope_base, 1.0));
        }
        let linear = [
            (MetaKey::SlidingWindow, Value::U32(4096)),
            (MetaKey::RopeScalingType, Value::Str("linear".into())),
            (MetaKey::RopeScalingFactor, Value::F32(2.0)),
        ];
        assert!(hparams("llama", &linear).is_err());
    }

    #[test]
    fn mistral3_refuses_what_it_does_not_run() {
        let yarn = [(MetaKey::RopeScalingType, Value::Str("yarn".into()))];
        let e = hparams("mistral3", &yarn).unwrap_err().to_string();
        assert!(e.contains("mistral3.rope.scaling.type = yarn"), "{e}");
        let temp = [(MetaKey::AttnTemperatureScale, Value::F32(0.1))];
        let e = hparams("mistral3", &temp).unwrap_err().to_string();
        assert!(e.contains("temperature"), "{e}");
        assert!(hparams("mistral3", &[]).unwrap().sliding.iter().all(|s| !s));
    }
}
