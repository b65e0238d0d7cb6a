//! Text ↔ token ids with the Hugging Face `tokenizers` library, from a model folder's
//! `tokenizer.json`. Rendered chat templates already contain their special tokens as text
//! (`<|im_start|>`), so encoding adds none and matches special tokens in the text, as transformers'
//! `apply_chat_template(tokenize=True)` does.

use std::path::Path;

/// Errors of loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenize(String),
}

/// A model's tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model folder.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(Self { inner })
    }

    /// The ids of `text`, special tokens in it included, none added.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, TokenizerError> {
        let encoding = self.inner.encode(text, false);
        let encoding = encoding.map_err(|e| TokenizerError::Tokenize(e.to_string()))?;
        Ok(encoding.get_ids().iter().map(|&id| i64::from(id)).collect())
    }

    /// The text of `ids`; special tokens kept unless `skip_special_tokens`.
    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        let ids = ids.iter().map(|&id| u32::try_from(id).map_err(|_| id));
        let ids: Vec<u32> = ids.collect::<Result<_, _>>().map_err(|id| {
            TokenizerError::Tokenize(format!("token id {id} is negative or too large"))
        })?;
        let text = self.inner.decode(&ids, skip_special_tokens);
        text.map_err(|e| TokenizerError::Tokenize(e.to_string()))
    }

    /// The id of a token by its text (`<|image_pad|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
