//! stoke-plan: a memory and time model of parallel training layouts, and a search over them.
//!
//! Not built yet: `stoke plan` will rank data x tensor x pipeline layouts, ZeRO stages,
//! recomputation and micro-batch choices by predicted memory and step time.
