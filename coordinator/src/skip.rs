//! Predictive layer skip for the commands that run a model (`run`, `bench`, `perplexity`,
//! and later `up`): what `--skip` asks for, where the predictor file is, and loading it for a
//! model (`ringllm_model::skip` holds the predictor and its training, `Runner::set_skip` the
//! skipping).

use anyhow::{Context, Result};
use ringllm_model::skip::{Predictor, SkipModelId, SkipPolicy};
use ringllm_model::{Model, Runner};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

/// `--skip`: off, or `auto` with the predictor beside the model (`<model>.skip`) or at a
/// given path.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum SkipSetting {
    #[default]
    Off,
    Auto(Option<PathBuf>),
}

impl FromStr for SkipSetting {
    type Err = String;

    fn from_str(s: &str) -> Result<SkipSetting, String> {
        match s {
            "off" => Ok(SkipSetting::Off),
            "auto" => Ok(SkipSetting::Auto(None)),
            _ => match s.strip_prefix("auto:") {
                Some("") => Err("`auto:` needs a predictor file after the colon".into()),
                Some(p) => Ok(SkipSetting::Auto(Some(PathBuf::from(p)))),
                None => Err(format!(
                    "'{s}': expected `auto` (the predictor MODEL.skip beside the model) or \
                     `auto:FILE`"
                )),
            },
        }
    }
}

/// Everything `--skip` and its companions ask for.
#[derive(Clone, Debug, PartialEq)]
pub struct SkipOptions {
    pub setting: SkipSetting,
    /// Most layers one token skips in a row.
    pub max_skip: usize,
    /// Probability a skip needs.
    pub confidence: f32,
}

impl Default for SkipOptions {
    fn default() -> Self {
        SkipOptions {
            setting: SkipSetting::Off,
            max_skip: ringllm_model::skip::DEFAULT_MAX_SKIP,
            confidence: ringllm_model::skip::DEFAULT_CONFIDENCE,
        }
    }
}

/// Where `calibrate` writes and `--skip auto` looks: `<model path>.skip`.
pub fn default_predictor_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(".skip");
    PathBuf::from(s)
}

/// The policy `opts` asks for with the model at `model_path` (`None`: off). Fails with a
/// message naming the predictor file when it is missing, damaged or for another model.
pub fn load_policy(
    opts: &SkipOptions,
    model_path: &Path,
    model: &Model,
) -> Result<Option<SkipPolicy>> {
    let path = match &opts.setting {
        SkipSetting::Off => return Ok(None),
        SkipSetting::Auto(Some(p)) => p.clone(),
        SkipSetting::Auto(None) => {
            let p = default_predictor_path(model_path);
            if !p.exists() {
                anyhow::bail!(
                    "--skip auto: no predictor {} beside the model; make one with `ringllm \
                     calibrate -m {} -f TEXT` or give --skip auto:FILE",
                    p.display(),
                    model_path.display()
                );
            }
            p
        }
    };
    let predictor = Predictor::load(&path, &SkipModelId::of(model))?;
    tracing::info!(
        file = %path.display(),
        rank = predictor.rank,
        decision_layer = predictor.decision_layer,
        "skip predictor loaded"
    );
    Ok(Some(SkipPolicy {
        max_skip: opts.max_skip,
        confidence: opts.confidence,
        ..SkipPolicy::new(Arc::new(predictor))
    }))
}

/// Loads the policy `opts` asks for and sets it on `runner`.
pub fn apply(runner: &mut Runner, opts: &SkipOptions, model_path: &Path) -> Result<()> {
    let model = Arc::clone(&runner.model);
    let policy = load_policy(opts, model_path, &model)?;
    runner
        .set_skip(policy)
        .with_context(|| format!("cannot use a skip predictor with {}", model_path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_setting_parses() {
        assert_eq!("auto".parse(), Ok(SkipSetting::Auto(None)));
        assert_eq!("off".parse(), Ok(SkipSetting::Off));
        assert_eq!(
            "auto:/x/y.skip".parse(),
            Ok(SkipSetting::Auto(Some(PathBuf::from("/x/y.skip"))))
        );
        assert!("auto:".parse::<SkipSetting>().is_err());
        let e = "yes".parse::<SkipSetting>().expect_err("bad");
        assert!(e.contains("'yes'"), "{e}");
        assert_eq!(
            default_predictor_path(Path::new("m/a.gguf")),
            PathBuf::from("m/a.gguf.skip")
        );
    }
}
