//! Splitting an input that holds several policy documents (a file of
//! `--policy-dir`, the input of `rivet policy apply`) into its documents, the
//! same way for every reader.
//!
//! The input is either
//! - a **JSON array**, when its first character that is not white space is
//!   `[`: each item is a document (re-serialised as pretty JSON), located
//!   as `item N`; or
//! - a **YAML stream**: documents are separated by marker lines. A line that
//!   starts with `---` followed by nothing or white space starts the next
//!   document; what follows the marker on its line belongs to that document
//!   (`--- {kind: ...}`), unless it is a comment. A line `...` (the same
//!   way) ends the current document; text after it forms the next one even
//!   without a `---` (as YAML 1.2 allows). Markers are recognised only in
//!   column 0: an indented `---` (inside a block scalar) is content. A
//!   single JSON object is YAML too, so it is one document.
//!
//! A byte order mark is ignored and CRLF line ends are kept as they are.
//! Documents with nothing but blank lines and comments (a header comment
//! before the first `---`, a trailing `---`) are not documents: they are
//! skipped and not counted, so `document 2` is the second policy in the
//! input. Each YAML document is located by its first line that is not blank
//! or a comment (`line 14`), counted from 1 in the whole input.
//!
//! Not supported: YAML directives (`%YAML 1.2`), Kubernetes `kind: List`.

use std::fmt;

use crate::PolicyError;

/// Where a document is in its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// A YAML document: its first line that is not blank or a comment,
    /// from 1.
    Line(usize),
    /// An item of a JSON array, from 1.
    Item(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Line(n) => write!(f, "line {n}"),
            Self::Item(n) => write!(f, "item {n}"),
        }
    }
}

/// One document of an input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// Its position among the input's documents, from 1.
    pub number: usize,
    /// Where it is in the input.
    pub location: Location,
    /// Its text.
    pub text: String,
}

impl fmt::Display for Document {
    /// `document 2 (line 14)`, as messages name it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {} ({})", self.number, self.location)
    }
}

/// Why an input with several policy documents was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocumentsError {
    /// The input starts with `[` but is not a JSON array.
    #[error("not a JSON array of policy objects: {reason}")]
    NotAJsonArray {
        /// The JSON parser's message (with line and column).
        reason: String,
    },
    /// One document is not a valid policy
    /// ([`Policy::parse_all`](crate::Policy::parse_all)).
    #[error("document {number} ({location}): {error}")]
    Document {
        /// Its position among the input's documents, from 1.
        number: usize,
        /// Where it is in the input.
        location: Location,
        /// What is wrong with it.
        error: PolicyError,
    },
}

/// Splits `input` into its documents (see the module docs for the rules).
///
/// ```
/// use rivet_policy::documents::{Location, split_documents};
///
/// let docs = split_documents("# shop\n---\nkind: A\n--- # next\nkind: B\n").unwrap();
/// assert_eq!(docs.iter().map(|d| d.text.as_str()).collect::<Vec<_>>(), ["kind: A\n", "kind: B\n"]);
/// assert_eq!(docs[1].location, Location::Line(5));
/// assert_eq!(docs[1].to_string(), "document 2 (line 5)");
/// ```
pub fn split_documents(input: &str) -> Result<Vec<Document>, DocumentsError> {
    let input = input.strip_prefix('\u{feff}').unwrap_or(input);
    if input.trim_start().starts_with('[') {
        let items: Vec<serde_json::Value> =
            serde_json::from_str(input).map_err(|e| DocumentsError::NotAJsonArray { reason: e.to_string() })?;
        return Ok(items
            .iter()
            .enumerate()
            .map(|(i, item)| Document {
                number: i + 1,
                location: Location::Item(i + 1),
                text: serde_json::to_string_pretty(item).expect("a JSON value is serialisable"),
            })
            .collect());
    }
    let mut docs = Vec::new();
    // The document being collected and its first line with content.
    let mut text = String::new();
    let mut first: Option<usize> = None;
    let mut finish = |text: &mut String, first: &mut Option<usize>| {
        if let Some(line) = first.take() {
            docs.push(Document {
                number: docs.len() + 1,
                location: Location::Line(line),
                text: std::mem::take(text),
            });
        }
        text.clear();
    };
    for (i, line) in input.split_inclusive('\n').enumerate() {
        let number = i + 1;
        let bare = line.trim_end_matches(['\n', '\r']);
        match marker(bare) {
            Some(Marker::Start { with_content }) => {
                finish(&mut text, &mut first);
                if with_content {
                    text.push_str(line);
                    first = Some(number);
                }
            }
            Some(Marker::End) => finish(&mut text, &mut first),
            None => {
                let content = bare.trim_start();
                if first.is_none() && !content.is_empty() && !content.starts_with('#') {
                    first = Some(number);
                }
                text.push_str(line);
            }
        }
    }
    finish(&mut text, &mut first);
    Ok(docs)
}

/// A YAML document marker line.
#[derive(Debug, PartialEq, Eq)]
enum Marker {
    /// `---`, with the document's first node on the same line or not.
    Start { with_content: bool },
    /// `...`.
    End,
}

fn marker(line: &str) -> Option<Marker> {
    // A marker is three characters at the start of a line, followed by
    // nothing or by white space.
    let rest_of = |prefix: &str| {
        line.strip_prefix(prefix)
            .filter(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
            .map(str::trim)
    };
    if let Some(rest) = rest_of("---") {
        return Some(Marker::Start {
            with_content: !rest.is_empty() && !rest.starts_with('#'),
        });
    }
    rest_of("...").map(|_| Marker::End)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(input: &str) -> Vec<(String, String)> {
        split_documents(input)
            .unwrap()
            .into_iter()
            .map(|d| (d.location.to_string(), d.text))
            .collect()
    }

    fn doc(location: &str, text: &str) -> (String, String) {
        (location.to_string(), text.to_string())
    }

    #[test]
    fn one_document_without_markers() {
        assert_eq!(texts("kind: A\nspec: {}\n"), [doc("line 1", "kind: A\nspec: {}\n")]);
        assert_eq!(texts("kind: A"), [doc("line 1", "kind: A")]);
        assert_eq!(texts(""), []);
        assert_eq!(texts("# only a comment\n\n"), []);
    }

    #[test]
    fn documents_at_markers() {
        let input = "# header\n---\nkind: A\n--- # second\n\nkind: B\n---\n---\n# empty\n...\nkind: C\n";
        assert_eq!(
            texts(input),
            [
                doc("line 3", "kind: A\n"),
                doc("line 6", "\nkind: B\n"),
                doc("line 11", "kind: C\n"),
            ]
        );
        let numbers: Vec<usize> = split_documents(input).unwrap().iter().map(|d| d.number).collect();
        assert_eq!(numbers, [1, 2, 3], "empty documents are not counted");
        // The first node on the marker line belongs to the document.
        assert_eq!(
            texts("--- {kind: A}\n--- {kind: B}\n"),
            [doc("line 1", "--- {kind: A}\n"), doc("line 2", "--- {kind: B}\n")]
        );
        // CRLF line ends, a byte order mark, a trailing marker.
        assert_eq!(
            texts("\u{feff}kind: A\r\n---\r\nkind: B\r\n---\r\n"),
            [doc("line 1", "kind: A\r\n"), doc("line 3", "kind: B\r\n")]
        );
        // `...` ends a document; what follows is the next one.
        assert_eq!(
            texts("kind: A\n...\nkind: B\n...\n"),
            [doc("line 1", "kind: A\n"), doc("line 3", "kind: B\n")]
        );
    }

    #[test]
    fn lookalikes_are_not_markers() {
        let input = "kind: A\n----\n---x\n  ---\nd: |\n  ---\n...more\n";
        assert_eq!(texts(input), [doc("line 1", input)]);
    }

    #[test]
    fn json_object_and_array() {
        let object = "{\"kind\": \"NetworkPolicy\", \"metadata\": {\"name\": \"a\"}}\n";
        assert_eq!(texts(object), [doc("line 1", object)]);
        let docs = texts("  [{\"kind\": \"A\"}, {\"kind\": \"B\"}]");
        assert_eq!(
            docs,
            [
                doc("item 1", "{\n  \"kind\": \"A\"\n}"),
                doc("item 2", "{\n  \"kind\": \"B\"\n}")
            ]
        );
        assert_eq!(texts("[]"), []);
        let err = split_documents("[{\"kind\": ").unwrap_err();
        assert!(matches!(&err, DocumentsError::NotAJsonArray { .. }), "{err:?}");
        assert!(
            err.to_string().starts_with("not a JSON array of policy objects: "),
            "{err}"
        );
    }
}
