//! The kernel's replies as egressgw reads them: rtnetlink messages, the
//! ethtool features reply, ctnetlink dumps, nft's JSON listings. The first
//! byte picks which.
#![no_main]

use egressgw_dataplane::decode::{Reply, kernel_reply, pick};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Some((kind, data)) = pick(&Reply::ALL, input) {
        kernel_reply(kind, data);
    }
});
