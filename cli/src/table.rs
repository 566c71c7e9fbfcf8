//! Plain aligned tables for human output.

use std::fmt::Write;

/// A table with a header row; columns are padded to their widest cell.
///
/// ```
/// let mut t = rivet_cli::table::Table::new(["POOL", "SIZE"]);
/// t.row(["default", "253"]);
/// assert_eq!(t.render(), "POOL     SIZE\ndefault  253\n");
/// ```
#[derive(Debug, Clone)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new<const N: usize>(headers: [&str; N]) -> Self {
        Self {
            rows: vec![headers.iter().map(|h| h.to_string()).collect()],
        }
    }

    /// Appends a row.
    pub fn row<I, S>(&mut self, cells: I) -> &mut Self
    where
        I: IntoIterator<Item = S>,
        S: ToString,
    {
        self.rows.push(cells.into_iter().map(|c| c.to_string()).collect());
        self
    }

    /// The table as text, two spaces between columns, no trailing spaces.
    pub fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let _ = write!(line, "{cell:<w$}  ", w = widths[c]);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}
