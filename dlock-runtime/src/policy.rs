//! Named lock policies: settings that ops teams change without touching code.
//!
//! A policy names any of ttl, wait, backend, watchdog, on_busy, hold_at_least and on_lost.
//! `#[distributed_lock(policy = "payments", ...)]` takes its settings from the policy; options
//! written in the attribute win over it. Precedence, highest first:
//! attribute > environment > policy file > policy defined in code > built-in defaults.

use std::collections::HashMap;
use std::sync::{LazyLock, RwLock};
use std::time::Duration;

use crate::LockError;

/// What a `#[distributed_lock]` function does when the lock is taken by someone else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnBusy {
    /// Return the busy / timed-out [`LockError`] (converted with `Into`).
    Error,
    /// Do not run the body; return `()` or `None`.
    Skip,
}

/// What a `#[distributed_lock]` function does when the lease is lost while its body runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLost {
    /// Drop the body future at its next `.await` and return [`LockError::Lost`].
    Cancel,
    /// Let the body finish.
    Continue,
}

/// A named set of lock settings; every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// Lease length.
    pub ttl: Option<Duration>,
    /// How long to wait for a busy lock.
    pub wait: Option<Duration>,
    /// Registered backend name.
    pub backend: Option<String>,
    /// Whether the watchdog renews the lease.
    pub watchdog: Option<bool>,
    /// What to do when the lock is busy.
    pub on_busy: Option<OnBusy>,
    /// Minimum time the lock stays taken after acquisition.
    pub hold_at_least: Option<Duration>,
    /// What to do when the lease is lost.
    pub on_lost: Option<OnLost>,
}

impl Policy {
    /// An empty policy (every setting from the layers below it).
    pub fn new() -> Self {
        Self::default()
    }

    /// Fills every field this policy leaves unset from `lower`.
    pub fn or(mut self, lower: &Policy) -> Policy {
        self.ttl = self.ttl.or(lower.ttl);
        self.wait = self.wait.or(lower.wait);
        self.backend = self.backend.or_else(|| lower.backend.clone());
        self.watchdog = self.watchdog.or(lower.watchdog);
        self.on_busy = self.on_busy.or(lower.on_busy);
        self.hold_at_least = self.hold_at_least.or(lower.hold_at_least);
        self.on_lost = self.on_lost.or(lower.on_lost);
        self
    }
}

static POLICIES: LazyLock<RwLock<HashMap<String, Policy>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// Defines (or replaces) the policy `name` in code.
pub fn define_policy(name: &str, policy: Policy) {
    POLICIES
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), policy);
}

/// The policy `name` with every layer applied, or [`LockError::UnknownPolicy`].
pub fn policy(name: &str) -> Result<Policy, LockError> {
    let map = POLICIES.read().unwrap_or_else(|e| e.into_inner());
    match map.get(name) {
        Some(p) => Ok(p.clone()),
        None => {
            let mut known: Vec<String> = map.keys().cloned().collect();
            known.sort();
            Err(LockError::UnknownPolicy {
                name: name.to_string(),
                known,
            })
        }
    }
}
