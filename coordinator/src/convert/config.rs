//! A checkpoint's `config.json`, read through typed getters that name the key they wanted.
//!
//! Multimodal checkpoints (Gemma 3 4B+, Mistral Small 3.1) keep the language model's keys in
//! `text_config`; those are read first, then the top level.

use super::ConvertError;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

pub struct HfConfig {
    pub path: PathBuf,
    top: Map<String, Value>,
    text: Option<Map<String, Value>>,
}

impl HfConfig {
    pub fn open(dir: &Path) -> Result<HfConfig, ConvertError> {
        let path = dir.join("config.json");
        let text = super::read_text(&path)?;
        Self::parse(path, &text)
    }

    pub fn parse(path: PathBuf, text: &str) -> Result<HfConfig, ConvertError> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConvertError::Config {
            file: path.clone(),
            key: String::new(),
            why: format!("not JSON: {e}"),
        })?;
        let Value::Object(top) = v else {
            return Err(ConvertError::Config {
                file: path,
                key: String::new(),
                why: "not a JSON object".into(),
            });
        };
        let text = top.get("text_config").and_then(Value::as_object).cloned();
        Ok(HfConfig { path, top, text })
    }

    fn bad(&self, key: &str, why: impl Into<String>) -> ConvertError {
        ConvertError::Config {
            file: self.path.clone(),
            key: key.to_string(),
            why: why.into(),
        }
    }

    /// The value of `key` (text_config first), `None` when absent or null.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.text
            .as_ref()
            .and_then(|t| t.get(key))
            .or_else(|| self.top.get(key))
            .filter(|v| !v.is_null())
    }

    /// The first entry of `architectures`.
    pub fn architecture(&self) -> Result<String, ConvertError> {
        let a = self
            .top
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| self.bad("architectures", "missing (a list naming the model class)"))?;
        Ok(a.to_string())
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, ConvertError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("{v} is not an integer below 2^32"))),
        }
    }

    pub fn u32(&self, key: &str) -> Result<u32, ConvertError> {
        self.opt_u32(key)?.ok_or_else(|| self.bad(key, "missing"))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, ConvertError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.bad(key, format!("{v} is not a number"))),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConvertError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("{v} is not true or false"))),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, ConvertError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("{v} is not a string"))),
        }
    }

    /// An object-valued key (`rope_scaling`).
    pub fn opt_object(&self, key: &str) -> Result<Option<&Map<String, Value>>, ConvertError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_object()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("{v} is not an object"))),
        }
    }

    /// A list of strings (`layer_types`).
    pub fn opt_str_list(&self, key: &str) -> Result<Option<Vec<&str>>, ConvertError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
                .map(Some)
                .ok_or_else(|| self.bad(key, "is not a list of strings")),
        }
    }

    /// A config error about `key` (for the checks the architectures make).
    pub fn error(&self, key: &str, why: impl Into<String>) -> ConvertError {
        self.bad(key, why)
    }
}
