#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| service_process::fuzz_targets::mcast_datagram(data));
