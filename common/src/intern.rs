//! Interned strings: one shared allocation per distinct text.
//!
//! A node knows every identity of the cluster (100,000 at scale), and their
//! labels repeat the same few keys and values (`app`,
//! `io.kubernetes.pod.namespace`, a namespace's name) in every set. An
//! [`Interned`] string is a reference-counted pointer into a process-wide
//! table, so equal texts share one allocation however many label sets hold
//! them. The table drops the texts nobody holds any more whenever it has
//! doubled since its last sweep, so churn (identities of deleted apps)
//! costs at most twice what is live.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::HashSet;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::{Arc, LazyLock, Mutex};

/// The table is swept when it holds at least this many texts.
const MIN_SWEEP_SIZE: usize = 1024;

/// An interned string: compares, orders and hashes as its text; clones
/// share the allocation.
///
/// ```
/// use rivet_common::intern::Interned;
///
/// let a = Interned::new("io.kubernetes.pod.namespace");
/// let b = Interned::new(&String::from("io.kubernetes.pod.namespace"));
/// assert!(Interned::ptr_eq(&a, &b));
/// assert_eq!(a, b);
/// assert_eq!(&*a, "io.kubernetes.pod.namespace");
/// assert!(Interned::new("a") < Interned::new("b"));
/// ```
#[derive(Clone)]
pub struct Interned(Arc<str>);

struct Table {
    texts: HashSet<Arc<str>>,
    /// Sweep when `texts` reaches this size.
    sweep_at: usize,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(|| {
    Mutex::new(Table {
        texts: HashSet::new(),
        sweep_at: MIN_SWEEP_SIZE,
    })
});

impl Interned {
    /// The shared copy of `text` (made now if no one holds one).
    pub fn new(text: &str) -> Self {
        let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(shared) = table.texts.get(text) {
            return Self(shared.clone());
        }
        if table.texts.len() >= table.sweep_at {
            // Only the table holds a text whose count is 1, and nobody can
            // take it without the lock held here.
            table.texts.retain(|t| Arc::strong_count(t) > 1);
            let live = table.texts.len();
            table.texts.shrink_to(2 * live);
            table.sweep_at = MIN_SWEEP_SIZE.max(2 * live);
        }
        let shared: Arc<str> = Arc::from(text);
        table.texts.insert(shared.clone());
        Self(shared)
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether both are the same allocation (always so for equal texts).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }

    /// How many distinct texts the process-wide table holds (swept or not).
    pub fn table_len() -> usize {
        TABLE.lock().unwrap_or_else(|e| e.into_inner()).texts.len()
    }
}

impl Default for Interned {
    fn default() -> Self {
        Self::new("")
    }
}

impl Deref for Interned {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Interned {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Interned {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl PartialEq for Interned {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || *self.0 == *other.0
    }
}

impl Eq for Interned {}

impl PartialEq<str> for Interned {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Interned {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialOrd for Interned {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Interned {
    fn cmp(&self, other: &Self) -> Ordering {
        if Arc::ptr_eq(&self.0, &other.0) {
            return Ordering::Equal;
        }
        self.0.cmp(&other.0)
    }
}

impl Hash for Interned {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl fmt::Debug for Interned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Interned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_texts_share_one_allocation() {
        let owned = String::from("intern-test-shared");
        let a = Interned::new("intern-test-shared");
        let b = Interned::new(&owned);
        assert!(Interned::ptr_eq(&a, &b));
        assert_eq!(a.as_ptr(), b.as_ptr());
        let c = Interned::new("intern-test-other");
        assert!(!Interned::ptr_eq(&a, &c));
        assert_ne!(a, c);
        // The table and the two holders.
        assert_eq!(Arc::strong_count(&a.0), 3);
    }

    #[test]
    fn orders_hashes_and_prints_as_its_text() {
        use std::collections::hash_map::DefaultHasher;
        let hash = |v: &dyn Fn(&mut DefaultHasher)| {
            let mut h = DefaultHasher::new();
            v(&mut h);
            h.finish()
        };
        let a = Interned::new("intern-test-a");
        assert_eq!(hash(&|h| a.hash(h)), hash(&|h| "intern-test-a".hash(h)));
        let mut sorted = [
            Interned::new("b"),
            Interned::new(""),
            Interned::new("ab"),
            Interned::new("a"),
        ];
        sorted.sort();
        let texts: Vec<&str> = sorted.iter().map(Interned::as_str).collect();
        assert_eq!(texts, ["", "a", "ab", "b"]);
        assert_eq!(format!("{a} {a:?}"), "intern-test-a \"intern-test-a\"");
        assert!(a == "intern-test-a");
        let set: HashSet<Interned> = [a.clone()].into();
        assert!(set.contains("intern-test-a"));
    }

    #[test]
    fn texts_nobody_holds_are_swept() {
        // Other tests intern concurrently: count only this test's texts.
        let held = Interned::new("intern-test-held");
        let ours = |table: &Table| {
            table
                .texts
                .iter()
                .filter(|t| t.starts_with("intern-test-churn-"))
                .count()
        };
        for i in 0..4 * MIN_SWEEP_SIZE {
            drop(Interned::new(&format!("intern-test-churn-{i}")));
        }
        let table = TABLE.lock().unwrap();
        // Each sweep removed the dropped texts: fewer are left than were made.
        assert!(ours(&table) < 2 * MIN_SWEEP_SIZE, "{}", ours(&table));
        assert!(table.texts.contains("intern-test-held"));
        assert!(table.texts.len() <= table.sweep_at);
        drop(table);
        // A held text survives and is still the same allocation.
        assert!(Interned::ptr_eq(&held, &Interned::new("intern-test-held")));
    }
}
