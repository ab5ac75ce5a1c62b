// Beam search's choice for one request at one step, from each of its rows' best candidates (the decoder graph's TopK):
// each row's score plus its candidate log-probs, EOS banned while the minimum length is not reached, the 2K best in
// (score descending, token id ascending, row ascending) order, and what BeamSearch._walk (model/search.py) picks from
// them. Included by beam_select.c (the choice alone) and beam_step.c (a whole steady beam step).
//
// Same choices, bit for bit, as the numpy path: a total is float64(log-prob) + row score, as numpy adds float32 and
// float64; every (row, token) pair is distinct, so the order is total and equals numpy's lexsort, which puts NaN last.

#ifndef NMT_BEAM_CHOICE_H
#define NMT_BEAM_CHOICE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
  double total;
  int64_t token;
  int64_t row;
} Candidate;

// Whether `a` comes before `b`: higher total first (NaN last), then the lower token id, then the lower row.
static int ahead(const Candidate* a, const Candidate* b) {
  const int a_nan = isnan(a->total), b_nan = isnan(b->total);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a->total != b->total) return a->total > b->total;
  if (a->token != b->token) return a->token < b->token;
  return a->row < b->row;
}

// Where a request's candidates are: row r's i-th log-prob (float32) at values + r * value_row + i * value_item, its
// token id (int64) likewise in `tokens`, and row r's score (float64) at scores + r * score_row; strides in bytes.
typedef struct {
  const char *values, *tokens, *scores;
  ptrdiff_t value_row, value_item, token_row, token_item, score_row;
} CandidateTable;

// The `want` best of `rows` x `needed` candidates into `best` (room for `want`), best first; returns how many it holds
// (fewer than `want` only where there are fewer candidates). One pass of insertions into a sorted list of 2K.
static ptrdiff_t best_candidates(const CandidateTable* table, ptrdiff_t rows, ptrdiff_t needed, int64_t eos_id, int ban_eos,
                                 ptrdiff_t want, Candidate* best) {
  ptrdiff_t filled = 0;
  for (ptrdiff_t row = 0; row < rows; ++row) {
    const char* value_row = table->values + row * table->value_row;
    const char* token_row = table->tokens + row * table->token_row;
    const double row_score = *(const double*)(table->scores + row * table->score_row);
    for (ptrdiff_t i = 0; i < needed; ++i) {
      Candidate candidate;
      candidate.token = *(const int64_t*)(token_row + i * table->token_item);
      candidate.row = row;
      candidate.total = (double)*(const float*)(value_row + i * table->value_item) + row_score;
      if (ban_eos && candidate.token == eos_id) candidate.total = -INFINITY;
      if (filled == want && !ahead(&candidate, &best[want - 1])) continue;
      ptrdiff_t at = filled < want ? filled++ : want - 1;
      for (; at > 0 && ahead(&candidate, &best[at - 1]); --at) best[at] = best[at - 1];
      best[at] = candidate;
    }
  }
  return filled;
}

// The walk over the best candidates (best first): an EOS among the K best finishes a hypothesis while fewer than K have
// (`finished` so far); the other K go on. Writes the indices into `best` of the choices, in order; returns how many.
static ptrdiff_t walk_candidates(const Candidate* best, ptrdiff_t filled, int64_t eos_id, ptrdiff_t beam_size, ptrdiff_t finished,
                                 ptrdiff_t* chosen) {
  ptrdiff_t count = 0, eos_taken = 0, live_taken = 0;
  for (ptrdiff_t rank = 0; rank < filled; ++rank) {
    if (best[rank].token == eos_id) {
      if (!(rank < beam_size && finished + eos_taken < beam_size)) continue;
      ++eos_taken;
    } else {
      if (live_taken >= beam_size) continue;
      ++live_taken;
    }
    chosen[count++] = rank;
  }
  return count;
}

#endif
