//! The daemons' config file (the chart's `feature` values).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Ok(text) = std::str::from_utf8(input) {
        egressgw_api::fuzz::config(text);
    }
});
