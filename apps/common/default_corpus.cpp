// The built-in training text: short chapters of a village chronicle, written from a small
// grammar of original sentence templates and word lists with a fixed seed. The text has the
// structure a byte-level model can learn within a minute (spelling, frequent words,
// punctuation, capitals after full stops, recurring names) while never repeating exactly.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "corpus.h"

namespace dtensor::train {
namespace {

// A small fixed-seed generator (xorshift64*): the corpus must be identical everywhere,
// independent of the standard library's distributions.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed ? seed : 1) {}
  uint64_t next() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    return s_ * 0x2545f4914f6cdd1dULL;
  }
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }
  template <size_t N>
  std::string_view pick(const std::array<std::string_view, N>& words) {
    return words[below(N)];
  }
  bool chance(int percent) { return below(100) < static_cast<size_t>(percent); }

 private:
  uint64_t s_;
};

constexpr std::array<std::string_view, 16> kNames = {
    "Ada",  "Tomas", "Mira",  "Elias", "Hanna", "Oskar", "Lena",  "Jonas",
    "Ruth", "Felix", "Clara", "Anton", "Vera",  "Paul",  "Irene", "Martin"};
constexpr std::array<std::string_view, 16> kRoles = {
    "miller", "weaver", "baker",    "shepherd", "smith",     "ferryman", "teacher", "potter",
    "fisher", "carter", "gardener", "clerk",    "innkeeper", "mason",    "doctor",  "beekeeper"};
constexpr std::array<std::string_view, 16> kPlaces = {
    "the mill",        "the river",       "the old bridge", "the market",
    "the schoolhouse", "the orchard",     "the harbour",    "the chapel",
    "the forge",       "the north field", "the inn",        "the long road",
    "the forest edge", "the well",        "the hill farm",  "the station"};
constexpr std::array<std::string_view, 16> kThings = {"a basket of apples",
                                                      "a letter",
                                                      "a lantern",
                                                      "a loaf of bread",
                                                      "a coil of rope",
                                                      "a jar of honey",
                                                      "a wooden box",
                                                      "a bundle of wool",
                                                      "a map",
                                                      "a broken clock",
                                                      "a pair of boots",
                                                      "a sack of flour",
                                                      "a small bell",
                                                      "a bottle of milk",
                                                      "a book of songs",
                                                      "a spade"};
constexpr std::array<std::string_view, 12> kTimes = {
    "At dawn",          "In the morning", "Before noon", "At midday",
    "In the afternoon", "Toward evening", "At dusk",     "After supper",
    "Late at night",    "On market day",  "On Sunday",   "The next day"};
constexpr std::array<std::string_view, 12> kWeather = {
    "the rain fell softly on the roofs",    "a cold wind came down from the hills",
    "the sun was warm on the stones",       "a grey fog lay over the water",
    "snow had covered the fields",          "the sky was clear and pale",
    "thunder rolled far to the west",       "the air smelled of cut grass",
    "the leaves were turning red and gold", "a light frost had settled on the fences",
    "the clouds hung low and heavy",        "the evening was still and mild"};
constexpr std::array<std::string_view, 16> kWent = {"walked to",
                                                    "hurried to",
                                                    "went down to",
                                                    "climbed up to",
                                                    "rode to",
                                                    "returned to",
                                                    "wandered toward",
                                                    "ran to",
                                                    "came back from",
                                                    "set out for",
                                                    "drove to",
                                                    "crossed to",
                                                    "looked for the path to",
                                                    "stopped at",
                                                    "waited near",
                                                    "slowly made for"};
constexpr std::array<std::string_view, 16> kDid = {"mended the fence",
                                                   "counted the sheep",
                                                   "swept the floor",
                                                   "lit the stove",
                                                   "wrote a long letter",
                                                   "fed the chickens",
                                                   "sharpened the knives",
                                                   "painted the door",
                                                   "carried water from the well",
                                                   "read aloud to the children",
                                                   "tuned the old fiddle",
                                                   "baked bread for the week",
                                                   "repaired the cart",
                                                   "planted beans in a row",
                                                   "sorted the mail",
                                                   "cleaned the windows"};
constexpr std::array<std::string_view, 12> kFeelings = {
    "tired",    "glad",    "worried",  "curious", "quiet",    "hopeful",
    "restless", "patient", "cheerful", "uneasy",  "grateful", "surprised"};
constexpr std::array<std::string_view, 12> kSaid = {
    "said",    "asked",    "whispered", "called", "answered", "replied",
    "laughed", "muttered", "sighed",    "warned", "promised", "explained"};
constexpr std::array<std::string_view, 16> kSpeech = {
    "The bridge will not hold another winter", "We should finish before the rain",
    "Have you seen the ferry today?",          "The bread is still warm",
    "Nobody remembers who built the well",     "Bring the lantern, it is getting dark",
    "The river is higher than last year",      "I will be back before supper",
    "There is a letter for you at the inn",    "The bees are quiet this morning",
    "Someone left the gate open again",        "We will need more flour by Friday",
    "The clock in the chapel has stopped",     "Listen, the geese are flying south",
    "It is a long road to the station",        "Keep the map dry and safe"};
constexpr std::array<std::string_view, 12> kReflections = {
    "It was the kind of day that people remember without knowing why.",
    "Nobody in the village thought it strange.",
    "The work was slow, but it was honest work.",
    "Such things happened often in those years.",
    "Later they would laugh about it.",
    "The old people said it had always been so.",
    "There was nothing more to be done that day.",
    "The children watched everything with wide eyes.",
    "In a small place, every small thing matters.",
    "It would be a long time before anyone mentioned it again.",
    "The dogs barked once and then were silent.",
    "Somewhere a door closed and a light went out."};
constexpr std::array<std::string_view, 8> kLinks = {
    "and then", "but first", "and afterwards", "while", "because", "so", "although", "until"};

std::string capitalize(std::string_view s) {
  std::string out(s);
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 32);
  return out;
}

class Chronicle {
 public:
  explicit Chronicle(uint64_t seed) : rng_(seed) {}

  // A villager, sometimes with their trade ("Ada the miller"); never the one at `not_index`.
  std::string person(size_t* index = nullptr, size_t not_index = kNames.size()) {
    size_t i = rng_.below(kNames.size());
    if (i == not_index) i = (i + 1) % kNames.size();
    if (index) *index = i;
    // The same name keeps the same trade, so the model can learn the pairing.
    return rng_.chance(50) ? std::string(kNames[i])
                           : std::string(kNames[i]) + " the " + std::string(kRoles[i]);
  }

  std::string sentence() {
    switch (rng_.below(10)) {
      case 0:
        return std::string(rng_.pick(kTimes)) + ", " + person() + " " +
               std::string(rng_.pick(kWent)) + " " + std::string(rng_.pick(kPlaces)) + ".";
      case 1:
        return person() + " " + std::string(rng_.pick(kDid)) + " " +
               std::string(rng_.pick(kLinks)) + " " + std::string(rng_.pick(kWeather)) + ".";
      case 2:
        return capitalize(rng_.pick(kWeather)) + ", and " + person() + " felt " +
               std::string(rng_.pick(kFeelings)) + ".";
      case 3: {
        const std::string who = person();
        const std::string_view words = rng_.pick(kSpeech);
        // A question keeps its question mark; a statement gets the comma before the speaker.
        return "\"" + std::string(words) + (words.ends_with('?') ? "\" " : ",\" ") +
               std::string(rng_.pick(kSaid)) + " " + who + ".";
      }
      case 4: {
        size_t giver = 0;
        const std::string from = person(&giver);
        return from + " brought " + std::string(rng_.pick(kThings)) + " to " +
               std::string(rng_.pick(kPlaces)) + " for " + person(nullptr, giver) + ".";
      }
      case 5:
        return std::string(rng_.pick(kReflections));
      case 6:
        return "At " + std::string(rng_.pick(kPlaces)) + ", " + person() + " found " +
               std::string(rng_.pick(kThings)) + " that nobody had missed.";
      case 7: {
        // A name always with its own trade, so the pairing recurs.
        const size_t i = rng_.below(kNames.size());
        return "Everyone knew that " + std::string(kNames[i]) + " the " + std::string(kRoles[i]) +
               " kept " + std::string(rng_.pick(kThings)) + " near " +
               std::string(rng_.pick(kPlaces)) + ".";
      }
      case 8: {
        size_t asker = 0;
        const std::string a = person(&asker);
        return "\"Where is " +
               std::string(kNames[(asker + 1 + rng_.below(kNames.size() - 1)) % kNames.size()]) +
               "?\" asked " + a + ". \"Gone to " + std::string(rng_.pick(kPlaces)) + ",\" " +
               std::string(rng_.pick(kSaid)) + " " + person(nullptr, asker) + ".";
      }
      default: {
        size_t first = 0;
        const std::string a = person(&first);
        return std::string(rng_.pick(kTimes)) + " " + a + " " + std::string(rng_.pick(kDid)) +
               ", and " + person(nullptr, first) + " " + std::string(rng_.pick(kDid)) + ".";
      }
    }
  }

  std::string paragraph() {
    std::string p;
    const size_t n = 2 + rng_.below(5);
    for (size_t i = 0; i < n; ++i) {
      if (i) p += ' ';
      p += sentence();
    }
    return p + "\n\n";
  }

 private:
  Rng rng_;
};

std::string generate(size_t target_bytes) {
  Chronicle chronicle(20240601);
  std::string text;
  text.reserve(target_bytes + 4096);
  int chapter = 0;
  static constexpr std::array<std::string_view, 10> kNumbers = {
      "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten"};
  while (text.size() < target_bytes) {
    ++chapter;
    text += "Chapter ";
    text += chapter <= 10 ? std::string(kNumbers[chapter - 1]) : std::to_string(chapter);
    text += "\n\n";
    for (int p = 0; p < 12 && text.size() < target_bytes; ++p) text += chronicle.paragraph();
  }
  return text;
}

}  // namespace

const std::string& default_corpus() {
  static const std::string text = generate(300 * 1024);
  return text;
}

}  // namespace dtensor::train
