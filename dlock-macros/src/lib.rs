//! Procedural macros of the `dlock` toolkit (see the `dlock` crate).
