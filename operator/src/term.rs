//! A term of leadership and the duties that run during one.
//!
//! The elector ([`crate::leader`]) hands each term it wins to the duties;
//! a duty checks [`Term::ensure`] right before every write it makes (to the
//! API server or the kvstore), so a replica that stopped renewing stops
//! writing before its lease can be taken: a term is valid only until the
//! renew deadline after its last successful renewal, which is shorter than
//! the lease duration another replica waits out before taking over.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use rivet_common::controller::Controllers;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// Why a duty may not write: this replica does not lead (any more).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not the leader: the term of {holder} (lease transition {transition}) {reason}")]
pub struct NotLeading {
    /// This replica's identity.
    pub holder: String,
    /// The lease's `leaseTransitions` when the term began.
    pub transition: i32,
    /// `ended` or `passed its renew deadline`.
    pub reason: &'static str,
}

/// One term of leadership. Cheap to clone; every clone sees the renewals
/// and the end.
#[derive(Debug, Clone)]
pub struct Term(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    holder: String,
    transition: i32,
    valid_until: Mutex<Instant>,
    ended: CancellationToken,
}

impl Term {
    /// A term of `holder` that began with lease transition `transition`,
    /// valid until `valid_until` unless renewed.
    pub fn begin(holder: impl Into<String>, transition: i32, valid_until: Instant) -> Self {
        Self(Arc::new(Inner {
            holder: holder.into(),
            transition,
            valid_until: Mutex::new(valid_until),
            ended: CancellationToken::new(),
        }))
    }

    /// This replica's identity (the lease's `holderIdentity`).
    pub fn holder(&self) -> &str {
        &self.0.holder
    }

    /// The lease's `leaseTransitions` when the term began.
    pub fn transition(&self) -> i32 {
        self.0.transition
    }

    /// A renewal succeeded: the term is valid until `valid_until`.
    pub fn renewed(&self, valid_until: Instant) {
        let mut until = self.0.valid_until.lock().unwrap_or_else(|e| e.into_inner());
        *until = (*until).max(valid_until);
    }

    /// Ends the term (lost, released or shut down); for good.
    pub fn end(&self) {
        self.0.ended.cancel();
    }

    /// `Ok` while this replica leads: the term has not ended and its renew
    /// deadline has not passed. Call it right before every write.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use rivet_operator::term::Term;
    /// let term = Term::begin("operator-a", 3, Instant::now() + Duration::from_secs(10));
    /// assert!(term.ensure().is_ok());
    /// term.end();
    /// assert!(term.ensure().is_err(), "an ended term must not write");
    /// ```
    pub fn ensure(&self) -> Result<(), NotLeading> {
        let not_leading = |reason| NotLeading {
            holder: self.0.holder.clone(),
            transition: self.0.transition,
            reason,
        };
        if self.0.ended.is_cancelled() {
            return Err(not_leading("ended"));
        }
        if Instant::now() >= *self.0.valid_until.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(not_leading("passed its renew deadline"));
        }
        Ok(())
    }

    /// Resolves when the term ends.
    pub fn ended(&self) -> WaitForCancellationFuture<'_> {
        self.0.ended.cancelled()
    }
}

/// A cluster-scope duty: started for each term this replica wins, on a
/// child set of controllers that is shut down when the term ends.
pub trait Duty: Send + Sync {
    /// The duty's name (`cluster-pool`, `identity-gc`, ...), for logs.
    fn name(&self) -> &'static str;

    /// Starts the duty's controllers for `term` on `controllers` (a set of
    /// its own, cancelled when the term ends). Every write checks
    /// [`Term::ensure`] first.
    fn start(&self, term: &Term, controllers: &Controllers);
}
