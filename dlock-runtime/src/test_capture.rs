//! Tests only: a process-wide tracing subscriber that keeps every event and span field as text
//! (backends log from their own driver threads, so a thread-local default would miss them).

use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};
use tracing::span;

pub(crate) static EVENTS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={:?} ", f.name(), v);
    }
}

fn push(s: String) {
    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).push(s);
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, a: &span::Attributes<'_>) -> span::Id {
        let mut f = Fields(format!("span {} ", a.metadata().name()));
        a.record(&mut f);
        push(f.0);
        span::Id::from_u64(1)
    }
    fn record(&self, _: &span::Id, r: &span::Record<'_>) {
        let mut f = Fields("record ".into());
        r.record(&mut f);
        push(f.0);
    }
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut f = Fields(format!("{} ", e.metadata().level()));
        e.record(&mut f);
        push(f.0);
    }
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

pub(crate) fn install() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        tracing::subscriber::set_global_default(Capture)
            .expect("no other global subscriber in dlock-runtime's unit tests");
    });
}

/// Every captured line containing `needle`.
pub(crate) fn containing(needle: &str) -> Vec<String> {
    EVENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|e| e.contains(needle))
        .cloned()
        .collect()
}
