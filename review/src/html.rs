//! The one way text reaches a page.
//!
//! A [`Page`] is built from two kinds of pieces: markup, which must be a
//! `&'static str` (a literal written in this crate, never data), and text,
//! which is always escaped ([`escape`]) whether it lands between tags or in
//! a quoted attribute value. Record fields, sample text, notes and query
//! values are all untrusted (an answer may hold `<script>`), so none of
//! them can be pushed as markup.

use std::fmt::Display;

/// Escapes `&`, `<`, `>`, `"` and `'`: safe between tags and inside a
/// double- or single-quoted attribute value.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    escape_into(&mut out, text);
    out
}

fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            other => out.push(other),
        }
    }
}

/// An HTML document under construction.
#[derive(Debug, Default)]
pub struct Page {
    out: String,
}

impl Page {
    /// An empty page.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends markup written in this crate.
    pub fn markup(&mut self, markup: &'static str) -> &mut Self {
        self.out.push_str(markup);
        self
    }

    /// Appends `text`, escaped.
    pub fn text(&mut self, text: &str) -> &mut Self {
        escape_into(&mut self.out, text);
        self
    }

    /// Appends the display form of `value`, escaped.
    pub fn show(&mut self, value: impl Display) -> &mut Self {
        self.text(&value.to_string())
    }

    /// Appends `<tag>text</tag>` for a literal tag name.
    pub fn element(&mut self, tag: &'static str, text: &str) -> &mut Self {
        self.markup("<").markup(tag).markup(">");
        self.text(text);
        self.markup("</").markup(tag).markup(">")
    }

    /// Appends `<a href="HREF">TEXT</a>`, both escaped. `href` must be a
    /// path this crate built (see [`crate::filter::Filter::query`]).
    pub fn link(&mut self, href: &str, text: &str) -> &mut Self {
        self.markup("<a href=\"").text(href).markup("\">");
        self.text(text).markup("</a>")
    }

    /// The finished document.
    pub fn finish(self) -> String {
        self.out
    }
}

/// Percent-encodes `text` for a query string value (RFC 3986 unreserved
/// characters pass through).
pub fn url_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_the_five_characters() {
        assert_eq!(
            escape(r#"<script>alert("x")</script> & 'y'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
        assert_eq!(escape("plain text, ünïcödé"), "plain text, ünïcödé");
        // Already-escaped text is escaped again, not trusted.
        assert_eq!(escape("&lt;"), "&amp;lt;");
    }

    #[test]
    fn page_escapes_text_and_attributes() {
        let mut page = Page::new();
        page.element("p", "<img src=x onerror=alert(1)>")
            .link("/?session=\"><script>", "a'b");
        let html = page.finish();
        assert_eq!(
            html,
            "<p>&lt;img src=x onerror=alert(1)&gt;</p>\
             <a href=\"/?session=&quot;&gt;&lt;script&gt;\">a&#39;b</a>"
        );
        assert!(!html.contains("<script"));
        assert!(!html.contains("<img"));
    }

    #[test]
    fn url_encode_keeps_only_unreserved() {
        assert_eq!(url_encode("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
        assert_eq!(
            url_encode("2026-11-30T12:00:00Z"),
            "2026-11-30T12%3A00%3A00Z"
        );
    }
}
