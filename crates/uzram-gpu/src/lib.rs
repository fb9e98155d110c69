//! uzram-gpu: compresses batches of 4 KiB pages to LZ4 on an NVIDIA GPU, behind
//! [`uzram_core::batch::BatchBackend`].
