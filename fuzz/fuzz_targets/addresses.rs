//! Address, prefix, range and MAC strings, as specs and config carry them.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Ok(text) = std::str::from_utf8(input) {
        egressgw_api::fuzz::addresses(text);
    }
});
