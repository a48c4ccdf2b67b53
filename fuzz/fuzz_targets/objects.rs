//! Objects as a user or the API server hands them over: YAML (or JSON)
//! documents of egressgw's kinds and Kubernetes' own, through loading,
//! validation, conversion to the planner's model, a whole plan and the
//! status written back.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Ok(text) = std::str::from_utf8(input) {
        egressgw_api::fuzz::objects(text);
    }
});
