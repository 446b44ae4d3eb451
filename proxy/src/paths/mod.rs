//! The ways a request is served, each a module: [`verified`] (canaries
//! in, verdict out), [`plain`] (`[verify] enabled = false`), [`local`]
//! (the bundled engine) and [`passthrough`] (endpoints with nothing to
//! verify, forwarded as they are). They do what they are told; which one serves a
//! request, and what happens when one fails, is the pipeline's decision
//! ([`crate::pipeline`]).

pub mod local;
pub mod passthrough;
pub mod plain;
pub mod verified;
