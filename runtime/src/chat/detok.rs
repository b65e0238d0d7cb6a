//! Incremental detokenization for streaming: text deltas that are safe to send, never half a
//! UTF-8 character, at a cost per token independent of the output's length.
//!
//! Byte-level tokens can split one character over several ids, so a token's text depends on its
//! neighbours. As text-generation-inference does, each step decodes a short window twice (before
//! and after the new ids) and emits the difference once it no longer ends in U+FFFD.

use super::tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, Default)]
pub struct DecodeStream {
    ids: Vec<i64>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl DecodeStream {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Adds one id; returns the text it completes (possibly empty).
    pub fn step(&mut self, tokenizer: &Tokenizer, id: i64) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let (window, skip) = (&self.ids[self.prefix_offset..], self.skip_special_tokens);
        let before = tokenizer.decode(&window[..self.read_offset - self.prefix_offset], skip)?;
        let after = tokenizer.decode(window, skip)?;
        if after.len() <= before.len() || after.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        // `after` extends `before` except where a dangling partial character was completed.
        let delta = after[common_prefix(&before, &after)..].to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }
}

fn common_prefix(a: &str, b: &str) -> usize {
    let first_difference = a.char_indices().zip(b.chars()).find(|((_, x), y)| x != y);
    first_difference.map_or(a.len().min(b.len()), |((i, _), _)| i)
}
