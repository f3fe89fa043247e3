#pragma once
// --hf: the fine-tuned model written back as a Hugging Face directory that transformers'
// from_pretrained loads (config.json and model.safetensors in the checkpoint's architecture and
// dtype, by models::save_hf), with the checkpoint's tokenizer files copied beside them.
#include <string>
#include <vector>

namespace dtensor::train {

class Trainer;

// The files of a save_pretrained directory that describe its tokenizer (and generation
// defaults); those present in the checkpoint are copied.
const std::vector<std::string>& hf_tokenizer_files();

// Collective (every rank calls it; global rank 0 writes). Under --pp the stages are gathered
// into one model first. Returns the files copied.
std::vector<std::string> export_hf_checkpoint(Trainer& trainer, const std::string& dir);

}  // namespace dtensor::train
