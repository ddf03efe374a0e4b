//! Owner ids after `fork()` (issue 7, deliverable 6): the child draws a new random prefix, so a
//! parent and its child never share an owner id (and so never own each other's locks).

use std::sync::Arc;

use dlock::{Backend, Lock, MemoryBackend};

/// An owner id minted the public way: a fresh acquisition on a private in-memory store.
fn mint_owner() -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
        let g = Lock::new("fork").with_backend(b).acquire().await.unwrap();
        let o = g.owner().to_string();
        g.release().await.unwrap();
        o
    })
}

fn prefix(owner: &str) -> &str {
    owner.split(':').next().unwrap()
}

#[test]
fn a_forked_child_mints_owner_ids_with_a_new_prefix() {
    let parent = mint_owner();
    let mut fds = [0i32; 2];
    // SAFETY: plain libc calls; the child only mints an id, writes it and leaves with _exit.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = match std::panic::catch_unwind(mint_owner) {
            Ok(o) => {
                let n = unsafe { libc::write(fds[1], o.as_ptr().cast(), o.len()) };
                if n == o.len() as isize { 0 } else { 2 }
            }
            Err(_) => 1,
        };
        unsafe { libc::_exit(code) };
    }
    unsafe { libc::close(fds[1]) };
    let mut out = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        out.extend_from_slice(&buf[..n as usize]);
    }
    unsafe { libc::close(fds[0]) };
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child failed: status {status}"
    );
    let child = String::from_utf8(out).unwrap();
    assert_eq!(prefix(&child).len(), 32, "{child}");
    assert_ne!(
        prefix(&parent),
        prefix(&child),
        "the child reuses its parent's owner prefix ({parent} / {child})"
    );
    // The parent keeps its own prefix.
    assert_eq!(prefix(&mint_owner()), prefix(&parent));
}
