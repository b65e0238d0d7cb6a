//! Exact token accounting for one session (docs/architecture.md, invariants 1 and 2; docs/loopback.md, segments).
//!
//! A session accumulates token sequences, one per segment. Each turn renders the request's
//! messages with the chat template; the turn *continues* an open segment only when its messages
//! extend that segment's last request (the next one being the assistant's reply) and the rendered
//! text starts with the segment's text: the previous rendering followed by the text of the ids the
//! engine sampled. Only the rest of the rendering is tokenized and appended (loss mask 0); the
//! sampled ids are never retokenized. Otherwise (the agent compacted its context, or the template
//! rewrote history, as Qwen3 does with earlier `<think>` blocks) the open segments are sealed and a
//! new one starts from the whole rendering.
//!
//! A turn with `n` samples leaves `n` open candidates; the next turn continues the one whose reply
//! the agent kept and seals the others. Planning a turn reads the session; only a turn that
//! finished is committed, so a failed or abandoned turn leaves no trace.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::turn::TurnOutput;
use crate::chat::{Image, Message, Role};

/// Routed expert ids of positions `start..` of a segment, as the engine returned them (base64 of
/// a `.npy` array of shape `(positions, layers, top_k)`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutedExperts {
    pub start: usize,
    pub data: String,
}

/// An image in a segment's prompt (docs/vision.md): where its placeholder tokens are and the
/// image itself, so the trainer computes the same vision features the engine did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentImage {
    /// The position of its first placeholder token in the segment's `token_ids`.
    pub offset: usize,
    /// Its placeholder tokens.
    pub tokens: usize,
    #[serde(flatten)]
    pub image: Image,
}

/// One accumulated token sequence: what the trainer receives.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    pub token_ids: Vec<i64>,
    /// 1 for tokens the engine sampled, 0 for rendered prompt, observation and template tokens.
    pub loss_mask: Vec<u8>,
    /// The behaviour logprob of each sampled token (0 where the mask is 0).
    pub logprobs: Vec<f32>,
    /// The policy version that sampled each token (`None` where the mask is 0).
    pub versions: Vec<Option<u64>>,
    pub routed_experts: Vec<RoutedExperts>,
    /// The images of the prompt, in order (vision-language models).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<SegmentImage>,
    /// Turns that contributed to this segment.
    pub turns: usize,
    /// On-policy distillation with a served teacher: its logprob of each token given the ones
    /// before (0 for the first), filled in before the batch is trained on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_logprobs: Option<Vec<f32>>,
}

impl Segment {
    /// Appends rendered tokens and the images among them (offsets relative to `ids`).
    fn push_rendered(&mut self, ids: &[i64], images: &[SegmentImage]) {
        let at = self.token_ids.len();
        self.images.extend(images.iter().map(|i| SegmentImage {
            offset: at + i.offset,
            ..i.clone()
        }));
        self.token_ids.extend_from_slice(ids);
        self.loss_mask.extend(std::iter::repeat_n(0, ids.len()));
        self.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
        self.versions.extend(std::iter::repeat_n(None, ids.len()));
    }

    fn push_sampled(&mut self, sample: &Sampled) {
        let n = sample.token_ids.len();
        self.token_ids.extend_from_slice(&sample.token_ids);
        self.loss_mask.extend(std::iter::repeat_n(1, n));
        self.logprobs.extend_from_slice(&sample.logprobs);
        self.versions
            .extend(sample.versions.iter().copied().map(Some));
    }

    /// Number of sampled (trainable) tokens.
    pub fn sampled_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m == 1).count()
    }
}

/// Encoded text: its ids, and the images among them with their placeholders' place.
pub type Encoded = (Vec<i64>, Vec<SegmentImage>);

/// What the engine produced for one sample of a turn.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampled {
    pub token_ids: Vec<i64>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<u64>,
    /// Routed experts of positions `routed_experts_start..` (prompt and sample).
    pub routed_experts: Option<String>,
}

#[derive(Debug)]
struct Open {
    segment: Segment,
    /// The rendering the segment's tokens stand for: the last request's rendered prompt followed
    /// by the text of the ids sampled for it.
    text: String,
    /// The last request's messages (shared by the candidates of one turn).
    messages: Arc<Vec<Message>>,
}

/// What a turn will send to the engine, and how it will be recorded.
#[derive(Debug)]
pub struct TurnPlan {
    /// Index of the open candidate the turn continues; `None` opens a new segment.
    pub continues: Option<usize>,
    rendered: String,
    /// Tokens of the rendering not yet in the segment (loss mask 0).
    pub new_ids: Vec<i64>,
    /// The images among `new_ids` (offsets relative to them).
    new_images: Vec<SegmentImage>,
    /// The whole prompt: the continued segment's tokens, then `new_ids`.
    pub prompt: Vec<i64>,
    /// Every image of the prompt, in order, and where its placeholders are in `prompt`: what
    /// the engine receives with it.
    pub images: Vec<SegmentImage>,
}

impl TurnPlan {
    /// The prompt as engines take it with its images: one placeholder token per image, which
    /// the engine expands to the image's tokens again (vLLM's form; docs/vision.md).
    pub fn engine_prompt(&self) -> Vec<i64> {
        let mut out = Vec::with_capacity(self.prompt.len());
        let mut at = 0;
        for span in &self.images {
            out.extend_from_slice(&self.prompt[at..=span.offset]);
            at = span.offset + span.tokens;
        }
        out.extend_from_slice(&self.prompt[at..]);
        out
    }

    /// The first position whose routed experts the engine should return: the earlier positions'
    /// were recorded with earlier turns, except the last sampled token's, which only this forward
    /// computes.
    pub fn routed_experts_start(&self) -> usize {
        (self.prompt.len() - self.new_ids.len()).saturating_sub(1)
    }
}

/// A session's recorded segments and its cache of answered requests.
#[derive(Debug, Default)]
pub struct Session {
    sealed: Vec<Segment>,
    open: Vec<Open>,
    /// Recent answered requests, for identical retries (bounded: `CACHED_TURNS`): a retry has
    /// the same key (a hash of everything but the messages) and the same messages.
    cache: VecDeque<(u64, Arc<Vec<Message>>, Arc<TurnOutput>)>,
    turns: usize,
}

/// Answers kept for retries: a retry comes right after its original, so a few suffice.
const CACHED_TURNS: usize = 8;

impl Session {
    /// Plans a turn for `messages` rendered as `rendered`. `tokenize` encodes the new text only,
    /// given the images it holds placeholders for (the messages' images not yet in the continued
    /// segment), and returns the ids and each image with its placeholders' place in them.
    pub fn plan<E>(
        &self,
        messages: &[Message],
        rendered: String,
        tokenize: impl FnOnce(&str, &[&Image]) -> Result<Encoded, E>,
    ) -> Result<TurnPlan, E> {
        let continues = self.open.iter().position(|o| {
            messages.len() > o.messages.len()
                && messages[..o.messages.len()] == o.messages[..]
                && messages[o.messages.len()].role == Role::Assistant
                && rendered.starts_with(&o.text)
        });
        let base = continues.map(|i| &self.open[i]);
        let base_text = base.map_or("", |o| o.text.as_str());
        let base_ids: &[i64] = base.map_or(&[], |o| &o.segment.token_ids);
        let base_images: &[SegmentImage] = base.map_or(&[], |o| &o.segment.images);
        // A continued segment's messages are the first of these, so its images come first.
        let images: Vec<&Image> = messages.iter().flat_map(Message::images).collect();
        let new = images.get(base_images.len()..).unwrap_or_default();
        let (new_ids, new_images) = tokenize(&rendered[base_text.len()..], new)?;
        let images = base_images.iter().cloned();
        let images = images.chain(new_images.iter().map(|i| SegmentImage {
            offset: base_ids.len() + i.offset,
            ..i.clone()
        }));
        Ok(TurnPlan {
            continues,
            images: images.collect(),
            rendered,
            prompt: [base_ids, &new_ids].concat(),
            new_ids,
            new_images,
        })
    }

    /// Records a finished turn: each sample becomes an open candidate (its text is the rendering
    /// followed by `sample_texts[i]`, the text of its ids); candidates the turn did not continue
    /// are sealed.
    pub fn commit(
        &mut self,
        plan: TurnPlan,
        messages: Arc<Vec<Message>>,
        samples: &[Sampled],
        sample_texts: Vec<String>,
    ) {
        let routed_start = plan.routed_experts_start();
        let base = plan.continues.map(|i| self.open.swap_remove(i).segment);
        self.sealed.extend(self.open.drain(..).map(|o| o.segment));
        self.turns += 1;
        // The last candidate takes the base segment and the rendering; only extra samples copy
        // them, so a turn costs what it adds, not the context.
        let mut base = Some((base.unwrap_or_default(), plan.rendered));
        let last = samples.len().saturating_sub(1);
        for (i, (sample, text)) in samples.iter().zip(sample_texts).enumerate() {
            let (mut segment, mut full) =
                if i == last { base.take() } else { base.clone() }.unwrap_or_default();
            segment.turns += 1;
            segment.push_rendered(&plan.new_ids, &plan.new_images);
            segment.push_sampled(sample);
            if let Some(data) = &sample.routed_experts {
                segment.routed_experts.push(RoutedExperts {
                    start: routed_start,
                    data: data.clone(),
                });
            }
            full.push_str(&text);
            self.open.push(Open {
                segment,
                text: full,
                messages: messages.clone(),
            });
        }
    }

    /// The answer recorded for an identical earlier request: same `key` (a hash of everything
    /// but the messages) and the same messages. Messages are compared only when their count
    /// matches, so a growing conversation never pays for the check.
    pub fn cached(&self, key: u64, messages: &[Message]) -> Option<Arc<TurnOutput>> {
        // Slices compare their lengths first.
        let mut cache = self.cache.iter();
        let found = cache.find(|(k, m, _)| *k == key && m[..] == *messages);
        found.map(|(_, _, answer)| answer.clone())
    }

    pub fn remember(&mut self, key: u64, messages: Arc<Vec<Message>>, answer: Arc<TurnOutput>) {
        if self.cache.len() == CACHED_TURNS {
            self.cache.pop_front();
        }
        self.cache.push_back((key, messages, answer));
    }

    /// All segments, sealed first, then the open candidates.
    fn all(&self) -> impl Iterator<Item = &Segment> {
        let open = self.open.iter().map(|o| &o.segment);
        self.sealed.iter().chain(open)
    }

    pub fn segments(&self) -> Vec<Segment> {
        self.all().cloned().collect()
    }

    pub fn turns(&self) -> usize {
        self.turns
    }

    /// Tokens recorded over all segments, open candidates included.
    pub fn tokens(&self) -> usize {
        self.all().map(|s| s.token_ids.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::Part;

    /// A stand-in tokenizer: one id per character (a module-level test of the bookkeeping; the
    /// loopback tests use the real tokenizer and template).
    fn chars(text: &str, images: &[&Image]) -> Result<(Vec<i64>, Vec<SegmentImage>), ()> {
        // `#` is an image's placeholder, three tokens once expanded.
        let mut ids = Vec::new();
        let mut spans = Vec::new();
        for c in text.chars() {
            if c == '#' {
                spans.push(SegmentImage {
                    offset: ids.len(),
                    tokens: 3,
                    image: images[spans.len()].clone(),
                });
                ids.extend([c as i64; 3]);
            } else {
                ids.push(c as i64);
            }
        }
        assert_eq!(spans.len(), images.len(), "a placeholder per new image");
        Ok((ids, spans))
    }

    fn user(t: &str) -> Message {
        Message::text(Role::User, t)
    }

    fn assistant(t: &str) -> Message {
        Message::text(Role::Assistant, t)
    }

    fn sampled(text: &str, version: u64) -> Sampled {
        let ids: Vec<i64> = text.chars().map(|c| c as i64).collect();
        Sampled {
            logprobs: ids.iter().map(|_| -0.5).collect(),
            versions: ids.iter().map(|_| version).collect(),
            token_ids: ids,
            routed_experts: None,
        }
    }

    fn render(messages: &[Message]) -> String {
        let mut s: String = messages
            .iter()
            .map(|m| {
                let images = "#".repeat(m.images().count());
                format!(
                    "<{}>{images}{}|",
                    m.role.as_str(),
                    m.content.clone().unwrap_or_default()
                )
            })
            .collect();
        s.push_str("<assistant>");
        s
    }

    fn turn(s: &mut Session, messages: Vec<Message>, reply: &str, version: u64) -> bool {
        let plan = s.plan(&messages, render(&messages), chars).unwrap();
        let continued = plan.continues.is_some();
        let sample = sampled(&format!("{reply}|"), version);
        s.commit(
            plan,
            Arc::new(messages),
            &[sample],
            vec![format!("{reply}|")],
        );
        continued
    }

    #[test]
    fn extending_turns_share_one_segment_with_exact_masks() {
        let mut s = Session::default();
        let m1 = vec![user("hi")];
        assert!(!turn(&mut s, m1.clone(), "yo", 0));
        let m2 = vec![user("hi"), assistant("yo"), user("more")];
        assert!(turn(&mut s, m2.clone(), "ok", 1));
        let segs = s.segments();
        assert_eq!(segs.len(), 1);
        let seg = &segs[0];
        let text: String = seg
            .token_ids
            .iter()
            .map(|&c| char::from_u32(c as u32).unwrap())
            .collect();
        assert_eq!(text, "<user>hi|<assistant>yo|<user>more|<assistant>ok|");
        let mask: String = seg.loss_mask.iter().map(|m| m.to_string()).collect();
        assert_eq!(mask, format!("{}111{}111", "0".repeat(20), "0".repeat(22)));
        assert_eq!(seg.turns, 2);
        assert_eq!(
            seg.versions.iter().flatten().copied().collect::<Vec<_>>(),
            vec![0, 0, 0, 1, 1, 1]
        );
    }

    fn with_image(t: &str, image: &str) -> Message {
        Message::with_parts(
            Role::User,
            vec![
                Part::Image {
                    image: Image::from_bytes("image/png", image.as_bytes()),
                },
                Part::Text { text: t.into() },
            ],
        )
    }

    #[test]
    fn images_are_kept_with_their_placeholders_and_continue_like_text() {
        let mut s = Session::default();
        let m1 = vec![with_image("what?", "png-1")];
        assert!(!turn(&mut s, m1.clone(), "a", 0));
        let mut m2 = m1.clone();
        m2.extend([assistant("a"), with_image("and?", "png-2")]);
        let plan = s.plan(&m2, render(&m2), chars).unwrap();
        assert!(plan.continues.is_some());
        // The engine gets both images, the first from the continued segment.
        let hashes: Vec<&str> = plan
            .images
            .iter()
            .map(|i| i.image.sha256.as_str())
            .collect();
        let first = Image::from_bytes("image/png", b"png-1").sha256;
        let second = Image::from_bytes("image/png", b"png-2").sha256;
        assert_eq!(hashes, [first.as_str(), second.as_str()]);
        // Engines get one placeholder per image, and expand it again.
        let engine: String = plan
            .engine_prompt()
            .iter()
            .map(|&c| char::from_u32(c as u32).unwrap())
            .collect();
        assert_eq!(engine, "<user>#what?|<assistant>a|<user>#and?|<assistant>");
        s.commit(plan, Arc::new(m2), &[sampled("b|", 1)], vec!["b|".into()]);
        let seg = &s.segments()[0];
        let text: String = seg
            .token_ids
            .iter()
            .map(|&c| char::from_u32(c as u32).unwrap())
            .collect();
        assert_eq!(
            text,
            "<user>###what?|<assistant>a|<user>###and?|<assistant>b|"
        );
        let spans: Vec<(usize, usize, &str)> = seg
            .images
            .iter()
            .map(|i| (i.offset, i.tokens, i.image.sha256.as_str()))
            .collect();
        let at = "<user>###what?|<assistant>a|<user>".len();
        assert_eq!(spans, [(6, 3, first.as_str()), (at, 3, second.as_str())]);
        for i in &seg.images {
            assert!(seg.token_ids[i.offset..i.offset + i.tokens]
                .iter()
                .all(|&t| t == '#' as i64));
            assert_eq!(seg.loss_mask[i.offset], 0);
        }
        // Segments carry the images through JSON (to the trainer).
        let json = serde_json::to_string(seg).unwrap();
        assert_eq!(&serde_json::from_str::<Segment>(&json).unwrap(), seg);
    }

    #[test]
    fn compaction_and_rewritten_history_seal_the_segment() {
        let mut s = Session::default();
        turn(&mut s, vec![user("hi")], "yo", 0);
        // The agent rewrote its reply: the rendering no longer starts with the sampled text.
        assert!(!turn(
            &mut s,
            vec![user("hi"), assistant("YO"), user("x")],
            "a",
            0
        ));
        // The agent dropped history (compaction).
        assert!(!turn(&mut s, vec![user("summary")], "b", 0));
        assert_eq!(s.segments().len(), 3);
        assert!(s.segments().iter().all(|g| g.turns == 1));
    }

    #[test]
    fn the_kept_sample_continues_and_the_others_are_sealed() {
        let mut s = Session::default();
        let m1 = vec![user("q")];
        let plan = s.plan(&m1, render(&m1), chars).unwrap();
        s.commit(
            plan,
            Arc::new(m1),
            &[sampled("a|", 0), sampled("b|", 0), sampled("c|", 0)],
            vec!["a|".into(), "b|".into(), "c|".into()],
        );
        assert!(turn(
            &mut s,
            vec![user("q"), assistant("b"), user("next")],
            "d",
            0
        ));
        let segs = s.segments();
        assert_eq!(segs.len(), 3);
        assert_eq!(segs.iter().filter(|g| g.turns == 2).count(), 1);
    }

    #[test]
    fn a_planned_turn_that_is_not_committed_leaves_no_trace() {
        let mut s = Session::default();
        turn(&mut s, vec![user("hi")], "yo", 0);
        let before = s.segments();
        let m = vec![user("other")];
        let _abandoned = s.plan(&m, render(&m), chars).unwrap();
        assert_eq!(s.segments(), before);
    }

    #[test]
    fn routed_experts_tile_the_sequence() {
        let mut s = Session::default();
        let m1 = vec![user("hi")];
        let p1 = s.plan(&m1, render(&m1), chars).unwrap();
        assert_eq!(p1.routed_experts_start(), 0);
        s.commit(p1, Arc::new(m1), &[sampled("yo|", 0)], vec!["yo|".into()]);
        let m2 = vec![user("hi"), assistant("yo"), user("x")];
        let p2 = s.plan(&m2, render(&m2), chars).unwrap();
        // The last sampled token was never fed to the model: its routing comes with this turn.
        assert_eq!(
            p2.routed_experts_start(),
            s.segments()[0].token_ids.len() - 1
        );
    }
}
