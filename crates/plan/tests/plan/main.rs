//! Integration tests of stoke-plan, one module per topic. Tests against published numbers cite
//! their source at the top of their module.

mod activations;
mod calibration;
mod megatron;
mod search;
mod zero;
