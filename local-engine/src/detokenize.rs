//! The text of a generation so far, decoded a token at a time.
//!
//! Decoding every generated token again at each step, and searching all of
//! that text for the stop strings, costs time in proportion to the answer's
//! length on every token: an 8,000-token answer spent most of its decode
//! step there, on the thread that decodes every running request. A
//! [`TextSoFar`] decodes each new token against a short window of the
//! tokens before it (`tokenizers`' decode stream, as vLLM and TGI do) and
//! searches only the text a stop string could newly end in. A decoder
//! whose earlier text changes with later tokens makes the stream fail; the
//! text is then decoded whole at each token, as before. When the answer
//! ends its text is decoded whole once, so the answer is the one a whole
//! decode gives.

use tokenizers::Tokenizer;
use tokenizers::tokenizer::step_decode_stream;

/// Generated text so far, and how much of it is known to hold no stop
/// string.
#[derive(Debug, Default)]
pub(crate) struct TextSoFar {
    text: String,
    /// The decode stream's window of tokens, the text they decoded to and
    /// where the window's new tokens start.
    window: Vec<u32>,
    window_text: String,
    window_start: usize,
    /// The stream failed: the text is decoded whole.
    whole: bool,
    /// Bytes of `text` in which no stop string ends.
    searched: usize,
}

impl TextSoFar {
    /// The text so far (a character still incomplete is left out until its
    /// last byte comes).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Adds the generated token `token`; `generated` is every generated
    /// token so far, it included (decoded whole when the stream cannot be).
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32, generated: &[u32]) {
        if !self.whole {
            let step = step_decode_stream(
                &**tokenizer,
                vec![token],
                true,
                &mut self.window,
                &mut self.window_text,
                &mut self.window_start,
            );
            match step {
                Ok(Some(piece)) => return self.text.push_str(&piece),
                Ok(None) => return,
                Err(_) => self.whole = true,
            }
        }
        self.decode_whole(tokenizer, generated);
    }

    /// Decodes `generated` (the answer's visible tokens) whole, as the
    /// answer's final text.
    pub fn finish(&mut self, tokenizer: &Tokenizer, generated: &[u32]) {
        self.decode_whole(tokenizer, generated);
    }

    fn decode_whole(&mut self, tokenizer: &Tokenizer, generated: &[u32]) {
        let text = tokenizer.decode(generated, true).unwrap_or_default();
        if !self.whole && !text.starts_with(&self.text) {
            // The answer's end, decoded whole, rewrites text the stream
            // already gave (what was sent cannot change): kept as it went.
            return;
        }
        if !text.starts_with(&self.text[..self.searched]) {
            // Earlier text changed: search it all again.
            self.searched = 0;
        }
        self.text = text;
    }

    /// The earliest stop string in the text (where it starts, and its index
    /// in `stops`, whose longest is `max_stop` bytes), searching only where
    /// one could end in text added since the last search.
    pub fn find_stop(&mut self, stops: &[String], max_stop: usize) -> Option<(usize, usize)> {
        let mut from = self.searched.saturating_sub(max_stop.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let window = &self.text[from..];
        let found = (stops.iter().enumerate())
            .filter(|(_, stop)| !stop.is_empty())
            .filter_map(|(index, stop)| window.find(stop.as_str()).map(|at| (from + at, index)))
            .min();
        if found.is_none() {
            self.searched = self.text.len();
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::tokenizer_json;

    fn tokenizer() -> Tokenizer {
        tokenizer_json(288).to_string().parse().unwrap()
    }

    #[test]
    fn text_decoded_a_token_at_a_time_is_the_whole_decode() {
        let tokenizer = tokenizer();
        // Multi-byte characters split over tokens, a special token skipped.
        let answer = "héllo wörld — 雪 ❄️ done";
        let mut generated: Vec<u32> = tokenizer.encode(answer, false).unwrap().get_ids().to_vec();
        generated.insert(3, tokenizer.token_to_id("<|eot_id|>").unwrap());
        let mut text = TextSoFar::default();
        let mut seen = Vec::new();
        for (at, &token) in generated.iter().enumerate() {
            text.push(&tokenizer, token, &generated[..=at]);
            assert!(!text.text().contains('\u{FFFD}'), "{:?}", text.text());
            seen.push(text.text().to_owned());
        }
        assert_eq!(text.text(), answer);
        // Append-only: each text starts with the one before.
        assert!(seen.windows(2).all(|pair| pair[1].starts_with(&pair[0])));
        text.finish(&tokenizer, &generated);
        assert_eq!(text.text(), answer);
    }

    #[test]
    fn stop_strings_are_found_across_pushes_and_only_once_searched() {
        let tokenizer = tokenizer();
        let stops = ["END".to_owned(), "wör".to_owned()];
        let generated: Vec<u32> = tokenizer
            .encode("abc EN", false)
            .unwrap()
            .get_ids()
            .to_vec();
        let mut text = TextSoFar::default();
        for (at, &token) in generated.iter().enumerate() {
            text.push(&tokenizer, token, &generated[..=at]);
            assert_eq!(text.find_stop(&stops, 4), None);
        }
        let mut generated = generated;
        for &token in tokenizer.encode("D and wör", false).unwrap().get_ids() {
            generated.push(token);
            text.push(&tokenizer, token, &generated);
            if let Some(found) = text.find_stop(&stops, 4) {
                // "END" ends with the first `D`: found where it starts.
                assert_eq!(found, (4, 0));
                return;
            }
        }
        panic!("no stop string found in {:?}", text.text());
    }

    /// Random bytes (ASCII, stray continuation bytes, lead bytes left
    /// incomplete), and a stop string of two characters of their text:
    /// found at the token where decoding everything again would find it.
    /// (A stop string holding U+FFFD is found once the character it stands
    /// for is known not to complete, not while it still may.)
    #[test]
    fn a_stop_string_is_found_at_the_token_a_whole_decode_finds_it() {
        let tokenizer = tokenizer();
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        };
        let mut compared = 0;
        for _ in 0..1000 {
            let len = 5 + next() % 30;
            let generated: Vec<u32> = (0..len)
                .map(|_| match next() % 4 {
                    0 => 0x80 + next() % 0x40,
                    1 => 0xC2 + next() % 0x30,
                    _ => 0x61 + next() % 4,
                })
                .collect();
            let whole = tokenizer.decode(&generated, true).unwrap();
            let chars: Vec<char> = whole.chars().filter(|&c| c != '\u{FFFD}').collect();
            if chars.len() < 3 {
                continue;
            }
            let at = (next() as usize) % (chars.len() - 1);
            let stop: String = chars[at..at + 2].iter().collect();
            let stops = [stop.clone()];
            let mut text = TextSoFar::default();
            let (mut whole_at, mut found_at) = (None, None);
            for index in 0..generated.len() {
                let so_far = &generated[..=index];
                let decoded = tokenizer.decode(so_far, true).unwrap();
                if whole_at.is_none() && decoded.contains(&stop) {
                    whole_at = Some(index);
                }
                text.push(&tokenizer, generated[index], so_far);
                if found_at.is_none() && text.find_stop(&stops, stop.len()).is_some() {
                    found_at = Some(index);
                }
            }
            assert_eq!(found_at, whole_at, "{generated:?}, stop {stop:?}");
            compared += 1;
        }
        assert!(compared > 500, "{compared}");
    }
}
