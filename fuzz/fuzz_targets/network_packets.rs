//! What the network sends egressgw: frames heard on the segment while an
//! EIP is checked, echo replies to the tunnel probes. The first byte picks
//! which.
#![no_main]

use egressgw_dataplane::decode::{Heard, network_packet, pick};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Some((kind, data)) = pick(&Heard::ALL, input) {
        network_packet(kind, data);
    }
});
