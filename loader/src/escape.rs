//! Plugin strings are data: before one reaches a terminal (`ferry info`,
//! log lines, error messages), every character that could move the cursor,
//! start an escape sequence or reorder text is shown as an escape instead.
//! JSON output keeps the strings exact, with the same characters written as
//! `\uXXXX` escapes ([`to_json`]), so a JSON document printed on a terminal
//! is as harmless as the text report.

use std::borrow::Cow;
use std::io::Write;

/// `text` with control characters (C0, DEL, C1), line and paragraph
/// separators and bidirectional overrides written as `\n`, `\t`, `\x1b`,
/// `\u{202e}`: safe to print on one line of a terminal.
pub fn for_terminal(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if !needs_escape(c) {
            out.push(c);
            continue;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x80 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    Cow::Owned(out)
}

/// JSON text of `value` (pretty or compact) in which every character
/// [`for_terminal`] would escape is a `\uXXXX` escape: any JSON parser
/// reads back the exact strings.
pub fn to_json<T: serde::Serialize + ?Sized>(
    value: &T,
    pretty: bool,
) -> serde_json::Result<String> {
    let mut out = Vec::new();
    if pretty {
        let mut ser = serde_json::Serializer::with_formatter(
            &mut out,
            Safe(serde_json::ser::PrettyFormatter::new()),
        );
        value.serialize(&mut ser)?;
    } else {
        let mut ser = serde_json::Serializer::with_formatter(
            &mut out,
            Safe(serde_json::ser::CompactFormatter),
        );
        value.serialize(&mut ser)?;
    }
    // The serializer writes UTF-8 only.
    Ok(String::from_utf8(out).unwrap_or_default())
}

/// A formatter that also escapes what a terminal would act on.
struct Safe<F>(F);

impl<F: serde_json::ser::Formatter> serde_json::ser::Formatter for Safe<F> {
    fn write_string_fragment<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let mut rest = fragment;
        while let Some((at, c)) = rest.char_indices().find(|(_, c)| needs_escape(*c)) {
            writer.write_all(&rest.as_bytes()[..at])?;
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(writer, "\\u{unit:04x}")?;
            }
            rest = &rest[at + c.len_utf8()..];
        }
        writer.write_all(rest.as_bytes())
    }

    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn end_object_key<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_key(w)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            // line and paragraph separators
            '\u{2028}' | '\u{2029}'
            // bidirectional embeddings, overrides and isolates ("Trojan Source")
            | '\u{202a}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}'
            | '\u{200e}' | '\u{200f}' | '\u{061c}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_borrowed() {
        assert!(matches!(
            for_terminal("RoCE v2, port 1 ACTIVE"),
            Cow::Borrowed(_)
        ));
        assert_eq!(for_terminal("naïve ünïcode ✓"), "naïve ünïcode ✓");
    }

    #[test]
    fn json_is_exact_and_safe_to_print() {
        let tricky = "a\x1b[2J\u{9b}\u{202e}b\x7f\n\"✓";
        for pretty in [false, true] {
            let text = to_json(&serde_json::json!({ "s": tricky }), pretty).unwrap();
            assert!(
                text.chars().all(|c| !needs_escape(c) || c == '\n'),
                "{text:?}"
            );
            assert!(text.contains("\\u202e") && text.contains("✓"), "{text}");
            let back: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(back["s"], tricky);
        }
    }

    #[test]
    fn escapes_become_visible() {
        assert_eq!(for_terminal("a\x1b[2Jb"), "a\\x1b[2Jb");
        assert_eq!(
            for_terminal("1.0\n      why: forged"),
            "1.0\\n      why: forged"
        );
        assert_eq!(for_terminal("\x1b]0;title\x07"), "\\x1b]0;title\\x07");
        assert_eq!(for_terminal("tab\there\r"), "tab\\there\\r");
        assert_eq!(for_terminal("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(for_terminal("abc\u{202e}fed"), "abc\\u{202e}fed");
        assert_eq!(for_terminal("del\x7f"), "del\\x7f");
    }
}
