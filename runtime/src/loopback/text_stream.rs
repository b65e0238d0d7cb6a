//! The text of one sample as it streams in: where a stop string ends it, and which of it is
//! certainly content and may be sent to a streaming client now.
//!
//! Content once sent is never taken back: text is held while it could still become the start of
//! a stop string or of a tool call, so the finished output's content always starts with what was
//! streamed, and the streamed pieces followed by [`TextStream::finish`]'s rest are exactly that
//! content, however the text was split into pieces.

use crate::chat::{ParsedOutput, ToolCallParser};

/// What one piece of text did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Streamed {
    /// Content that is now final (possibly empty).
    Content(String),
    /// A stop string matched: the text ends before it, and the sample is over.
    Stopped(String),
}

/// One sample's text, fed piece by piece ([`crate::chat::DecodeStream`]'s deltas).
#[derive(Debug)]
pub struct TextStream<'a> {
    stops: &'a [String],
    parser: &'a dyn ToolCallParser,
    text: String,
    /// Bytes of `text` already handed out as content.
    sent: usize,
}

/// How many trailing bytes of `text` could be the start of one of the stop strings.
fn partial_stop_len(text: &str, stops: &[String]) -> usize {
    let starts = |s: &String, k: usize| s.is_char_boundary(k) && text.ends_with(&s[..k]);
    let partial = |s: &String| (1..s.len()).rev().find(|&k| starts(s, k));
    stops.iter().filter_map(partial).max().unwrap_or(0)
}

impl<'a> TextStream<'a> {
    pub fn new(stops: &'a [String], parser: &'a dyn ToolCallParser) -> Self {
        Self {
            stops,
            parser,
            text: String::new(),
            sent: 0,
        }
    }

    /// Appends `piece`: the content it makes final, or the stop string it completes (the text
    /// is cut where that stop string starts).
    pub fn push(&mut self, piece: &str) -> Streamed {
        let before = self.text.len();
        self.text.push_str(piece);
        let (stops, text) = (self.stops, &self.text);
        // Only a stop string that ends in the new piece can be new.
        let from = before.saturating_sub(stops.iter().map(String::len).max().unwrap_or(0));
        let from = (0..=from).rfind(|&i| text.is_char_boundary(i)).unwrap_or(0);
        let found = |s: &'a String| Some((from + text[from..].find(s.as_str())?, s));
        if let Some((at, stop)) = stops.iter().filter_map(found).min_by_key(|(at, _)| *at) {
            self.text.truncate(at);
            return Streamed::Stopped(stop.clone());
        }
        let held = partial_stop_len(text, stops);
        let safe = self.parser.content_prefix_len(text).min(text.len() - held);
        let content = text.get(self.sent..safe).unwrap_or_default().to_string();
        self.sent = self.sent.max(safe);
        Streamed::Content(content)
    }

    /// The text so far (cut before a stop string that matched).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The finished output, and the content not streamed yet.
    pub fn finish(self) -> (ParsedOutput, String) {
        let parsed = self.parser.parse(&self.text);
        let rest = parsed.content.as_deref().and_then(|c| c.get(self.sent..));
        let rest = rest.unwrap_or_default().to_string();
        (parsed, rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_stops_are_held_back() {
        let stops = vec!["STOP".to_string(), "\n\n".to_string()];
        assert_eq!(partial_stop_len("abc ST", &stops), 2);
        assert_eq!(partial_stop_len("abc\n", &stops), 1);
        assert_eq!(partial_stop_len("abc", &stops), 0);
    }
}
