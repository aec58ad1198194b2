package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import cbserve.v1.Types;
import java.util.ArrayList;
import java.util.EnumSet;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import org.junit.jupiter.api.Test;

/** The SamplingParams message the client sends, and the finish reasons it reads (no server). */
class SamplingParamsTest {

  @Test
  void stopStringsGoInTheMessageInOrder() {
    SamplingParams params = SamplingParams.builder().stop("\n\n", "User:", "a").build();
    assertEquals(List.of("\n\n", "User:", "a"), params.toProto().getStopList());
    SamplingParams fromList = SamplingParams.builder().stop(List.of("b", "a")).build();
    assertEquals(List.of("b", "a"), fromList.toProto().getStopList());
    assertEquals(List.of(), SamplingParams.defaults().toProto().getStopList());
  }

  @Test
  void stopStringsAreCopiedAndTheLastSettingWins() {
    List<String> stop = new ArrayList<>(List.of("x", "y"));
    String[] array = {"p", "q"};
    SamplingParams.Builder builder = SamplingParams.builder().stop(array);
    array[0] = "changed";
    assertEquals(List.of("p", "q"), builder.build().toProto().getStopList());

    SamplingParams params = builder.stop(stop).build();
    stop.add("z");
    assertEquals(List.of("x", "y"), params.toProto().getStopList());
    assertEquals("SamplingParams{stop=[x, y]}", params.toString());
    assertEquals(List.of(), builder.stop().build().toProto().getStopList());
  }

  @Test
  void nullStopStringsAreRefused() {
    SamplingParams.Builder builder = SamplingParams.builder();
    NullPointerException e =
        assertThrows(NullPointerException.class, () -> builder.stop("ok", null));
    assertEquals("stop[1]", e.getMessage());
    assertThrows(NullPointerException.class, () -> builder.stop((String[]) null));
    assertThrows(NullPointerException.class, () -> builder.stop((List<String>) null));
  }

  @Test
  void penaltiesAndMinNewTokensGoInTheMessage() {
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(8)
            .repetitionPenalty(1.25)
            .presencePenalty(-0.5)
            .frequencyPenalty(1.5)
            .minNewTokens(3)
            .build();
    Types.SamplingParams proto = params.toProto();
    assertTrue(proto.hasRepetitionPenalty());
    assertEquals(1.25f, proto.getRepetitionPenalty());
    assertTrue(proto.hasPresencePenalty());
    assertEquals(-0.5f, proto.getPresencePenalty());
    assertTrue(proto.hasFrequencyPenalty());
    assertEquals(1.5f, proto.getFrequencyPenalty());
    assertTrue(proto.hasMinNewTokens());
    assertEquals(3, proto.getMinNewTokens());
    assertEquals(
        "SamplingParams{maxNewTokens=8, repetitionPenalty=1.25, presencePenalty=-0.5,"
            + " frequencyPenalty=1.5, minNewTokens=3}",
        params.toString());
  }

  @Test
  void zeroPenaltiesAreSentAndUnsetOnesAreNot() {
    // 0 (and 1 for repetitionPenalty) is a value the caller gave: it must reach the server as set.
    Types.SamplingParams zeros =
        SamplingParams.builder()
            .repetitionPenalty(1)
            .presencePenalty(0)
            .frequencyPenalty(0)
            .minNewTokens(0)
            .build()
            .toProto();
    assertTrue(zeros.hasRepetitionPenalty());
    assertTrue(zeros.hasPresencePenalty());
    assertTrue(zeros.hasFrequencyPenalty());
    assertTrue(zeros.hasMinNewTokens());

    Types.SamplingParams unset = SamplingParams.builder().maxNewTokens(4).build().toProto();
    assertFalse(unset.hasRepetitionPenalty());
    assertFalse(unset.hasPresencePenalty());
    assertFalse(unset.hasFrequencyPenalty());
    assertFalse(unset.hasMinNewTokens());
    Types.SamplingParams defaults = SamplingParams.defaults().toProto();
    assertFalse(defaults.hasRepetitionPenalty());
    assertFalse(defaults.hasPresencePenalty());
    assertFalse(defaults.hasFrequencyPenalty());
    assertFalse(defaults.hasMinNewTokens());
    assertEquals("SamplingParams{}", SamplingParams.defaults().toString());

    Types.SamplingParams onlyPresence =
        SamplingParams.builder().presencePenalty(2).build().toProto();
    assertTrue(onlyPresence.hasPresencePenalty());
    assertFalse(onlyPresence.hasRepetitionPenalty());
    assertFalse(onlyPresence.hasFrequencyPenalty());
    assertFalse(onlyPresence.hasMinNewTokens());
  }

  @Test
  void negativeMinNewTokensIsRefused() {
    SamplingParams.Builder builder = SamplingParams.builder();
    IllegalArgumentException e =
        assertThrows(IllegalArgumentException.class, () -> builder.minNewTokens(-1));
    assertEquals("sampling.min_new_tokens must be an int >= 0, got -1", e.getMessage());
    assertFalse(builder.build().toProto().hasMinNewTokens());
  }

  @Test
  void logitBiasGoesInTheMessage() {
    Map<Integer, Double> bias = new LinkedHashMap<>();
    bias.put(7, 100.0);
    bias.put(3, -100.0);
    bias.put(0, 0.5);
    SamplingParams params = SamplingParams.builder().maxNewTokens(2).logitBias(bias).build();
    assertEquals(Map.of(0, 0.5f, 3, -100f, 7, 100f), params.toProto().getLogitBiasMap());
    // Ordered by token id, whatever the caller's order.
    assertEquals(
        "SamplingParams{maxNewTokens=2, logitBias={0=0.5, 3=-100.0, 7=100.0}}", params.toString());
  }

  @Test
  void logitBiasIsCopiedAndTheLastSettingWins() {
    Map<Integer, Double> bias = new HashMap<>(Map.of(5, -1.5));
    SamplingParams.Builder builder = SamplingParams.builder().logitBias(bias);
    bias.put(6, 2.0);
    bias.put(5, 9.0);
    SamplingParams params = builder.build();
    bias.clear();
    assertEquals(Map.of(5, -1.5f), params.toProto().getLogitBiasMap());
    assertEquals("SamplingParams{logitBias={5=-1.5}}", params.toString());

    SamplingParams replaced = builder.logitBias(Map.of(9, 1.0)).build();
    assertEquals(Map.of(9, 1f), replaced.toProto().getLogitBiasMap());
    assertEquals(Map.of(5, -1.5f), params.toProto().getLogitBiasMap());
    SamplingParams cleared = builder.logitBias(Map.of()).build();
    assertEquals(Map.of(), cleared.toProto().getLogitBiasMap());
    assertEquals("SamplingParams{}", cleared.toString());
  }

  @Test
  void unsetLogitBiasIsEmpty() {
    assertEquals(Map.of(), SamplingParams.defaults().toProto().getLogitBiasMap());
    SamplingParams unset = SamplingParams.builder().maxNewTokens(4).build();
    assertEquals(0, unset.toProto().getLogitBiasCount());
    assertEquals("SamplingParams{maxNewTokens=4}", unset.toString());
  }

  @Test
  void negativeOrNullLogitBiasEntriesAreRefused() {
    SamplingParams.Builder builder = SamplingParams.builder().logitBias(Map.of(1, 1.0));
    IllegalArgumentException negative =
        assertThrows(
            IllegalArgumentException.class, () -> builder.logitBias(Map.of(2, 1.0, -1, 1.0)));
    assertEquals("sampling.logit_bias key must be an int >= 0, got -1", negative.getMessage());

    Map<Integer, Double> nullId = new HashMap<>();
    nullId.put(null, 1.0);
    assertThrows(NullPointerException.class, () -> builder.logitBias(nullId));
    Map<Integer, Double> nullBias = new HashMap<>();
    nullBias.put(4, null);
    NullPointerException e =
        assertThrows(NullPointerException.class, () -> builder.logitBias(nullBias));
    assertEquals("logitBias[4]", e.getMessage());
    assertThrows(NullPointerException.class, () -> builder.logitBias(null));
    // A refused setting leaves the earlier one in place.
    assertEquals(Map.of(1, 1f), builder.build().toProto().getLogitBiasMap());
  }

  @Test
  void finishReasonStopMapsToStop() {
    assertEquals(FinishReason.STOP, Convert.finishReason(Types.FinishReason.FINISH_REASON_STOP));
  }

  @Test
  void everyFinishReasonOfTheProtoMapsToTheWrapperOfTheSameName() {
    Set<FinishReason> mapped = EnumSet.noneOf(FinishReason.class);
    for (Types.FinishReason reason : Types.FinishReason.values()) {
      if (reason == Types.FinishReason.FINISH_REASON_UNSPECIFIED
          || reason == Types.FinishReason.UNRECOGNIZED) {
        continue;
      }
      FinishReason wrapper = Convert.finishReason(reason);
      assertNotNull(wrapper, reason + " has no wrapper");
      assertEquals(reason.name(), "FINISH_REASON_" + wrapper.name());
      mapped.add(wrapper);
    }
    assertEquals(EnumSet.allOf(FinishReason.class), mapped);
  }

  /** The message of the IllegalArgumentException that {@code setter} throws. */
  private static String refused(org.junit.jupiter.api.function.Executable setter) {
    return assertThrows(IllegalArgumentException.class, setter).getMessage();
  }

  @Test
  void maxNewTokensBelowTheServerMinimumIsRefused() {
    String message = refused(() -> SamplingParams.builder().maxNewTokens(0));
    assertEquals("sampling.max_new_tokens must be an int >= 1, got 0", message);
    assertEquals(1, SamplingParams.builder().maxNewTokens(1).build().toProto().getMaxNewTokens());
  }

  @Test
  void temperatureTopPAndRepetitionPenaltyOutsideTheirBoundsAreRefused() {
    assertEquals(
        "sampling.temperature must be a finite number >= 0, got -1.0",
        refused(() -> SamplingParams.builder().temperature(-1)));
    assertEquals(
        "sampling.temperature must be a finite number >= 0, got nan",
        refused(() -> SamplingParams.builder().temperature(Double.NaN)));
    assertEquals(
        "sampling.top_p must be a finite number in (0, 1], got 1.5",
        refused(() -> SamplingParams.builder().topP(1.5)));
    assertEquals(
        "sampling.repetition_penalty must be a finite number > 0 (1 disables it), got 0.0",
        refused(() -> SamplingParams.builder().repetitionPenalty(0)));
    assertEquals(
        "sampling.top_k must be an int >= 0 (0 disables it), got -1",
        refused(() -> SamplingParams.builder().topK(-1)));
    Types.SamplingParams edges =
        SamplingParams.builder().temperature(0).topP(1).repetitionPenalty(1).build().toProto();
    assertEquals(0f, edges.getTemperature());
    assertEquals(1f, edges.getTopP());
  }

  @Test
  void topLogprobsAboveTheBoundIsRefused() {
    int max = SamplingBounds.MAX_TOP_LOGPROBS;
    String message = refused(() -> SamplingParams.builder().topLogprobs(max + 1));
    assertEquals("sampling.top_logprobs must be an int in [0, 20], got 21", message);
    refused(() -> SamplingParams.builder().topLogprobs(-1));
    assertEquals(max, SamplingParams.builder().topLogprobs(max).build().toProto().getTopLogprobs());
  }

  @Test
  void presenceAndFrequencyPenaltiesOutsideTheBoundAreRefused() {
    double max = SamplingBounds.MAX_ABS_PRESENCE_FREQUENCY_PENALTY;
    String message = refused(() -> SamplingParams.builder().presencePenalty(max + 0.5));
    assertEquals("sampling.presence_penalty must be a finite number in [-2, 2], got 2.5", message);
    refused(() -> SamplingParams.builder().frequencyPenalty(-max - 0.5));
    refused(() -> SamplingParams.builder().frequencyPenalty(Double.NaN));
    refused(() -> SamplingParams.builder().presencePenalty(Double.POSITIVE_INFINITY));
    SamplingParams edges =
        SamplingParams.builder().presencePenalty(-max).frequencyPenalty(max).build();
    assertEquals((float) -max, edges.toProto().getPresencePenalty());
  }

  @Test
  void logitBiasOutsideTheBoundsIsRefused() {
    double max = SamplingBounds.MAX_ABS_LOGIT_BIAS;
    String message = refused(() -> SamplingParams.builder().logitBias(Map.of(3, max + 50)));
    assertEquals(
        "sampling.logit_bias[3] must be a finite number in [-100, 100], got 150.0", message);
    refused(() -> SamplingParams.builder().logitBias(Map.of(3, Double.NaN)));
    Map<Integer, Double> tooMany = new HashMap<>();
    for (int id = 0; id <= SamplingBounds.MAX_LOGIT_BIAS_ENTRIES; id++) {
      tooMany.put(id, 1.0);
    }
    assertEquals(
        "sampling.logit_bias: at most 300 entries, got 301",
        refused(() -> SamplingParams.builder().logitBias(tooMany)));
    tooMany.remove(0);
    assertEquals(
        SamplingBounds.MAX_LOGIT_BIAS_ENTRIES,
        SamplingParams.builder().logitBias(tooMany).build().toProto().getLogitBiasCount());
  }

  @Test
  void stopStringsOutsideTheBoundsAreRefused() {
    String[] tooMany = new String[SamplingBounds.MAX_STOP_STRINGS + 1];
    java.util.Arrays.fill(tooMany, "x");
    assertEquals(
        "sampling.stop: at most 16 strings, got 17",
        refused(() -> SamplingParams.builder().stop(tooMany)));
    assertEquals(
        "sampling.stop[1] must be 1 to 256 characters, got 0",
        refused(() -> SamplingParams.builder().stop("ok", "")));
    String longest = "x".repeat(SamplingBounds.MAX_STOP_STRING_CHARS);
    refused(() -> SamplingParams.builder().stop(longest + "x"));
    // Characters are code points, as the server counts them: 256 emoji pass.
    String emoji = "\uD83D\uDE00".repeat(SamplingBounds.MAX_STOP_STRING_CHARS);
    assertEquals(List.of(emoji), SamplingParams.builder().stop(emoji).build().toProto().getStopList());
  }

  @Test
  void minNewTokensAboveMaxNewTokensIsRefused() {
    SamplingParams.Builder builder = SamplingParams.builder().maxNewTokens(4).minNewTokens(5);
    assertEquals(
        "sampling.min_new_tokens (5) must not exceed max_new_tokens (4)", refused(builder::build));
    assertEquals(4, builder.minNewTokens(4).build().toProto().getMinNewTokens());
  }

  @Test
  void requestIdsOutsideTheBoundsAreRefused() {
    String longest = "i".repeat(SamplingBounds.MAX_REQUEST_ID_BYTES);
    assertEquals(longest, RequestOptions.builder().requestId(longest).build().requestId());
    String message = refused(() -> RequestOptions.builder().requestId(longest + "i"));
    assertEquals(
        "request_id must be at most 128 bytes of printable ASCII, got \"" + longest + "i\"",
        message);
    refused(() -> RequestOptions.builder().requestId("with space"));
    refused(() -> RequestOptions.builder().requestId("caf\u00e9"));
    refused(() -> RequestOptions.builder().requestId(""));
  }

  // -- min_p, stop_token_ids, skip_special_tokens, prompt_logprobs, structured_output, priority --

  @Test
  void theNewSamplingFieldsGoInTheMessage() {
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(8)
            .minP(0.25)
            .stopTokenIds(7, 3)
            .skipSpecialTokens(false)
            .promptLogprobs(2)
            .jsonSchema("{\"type\": \"object\"}")
            .build();
    Types.SamplingParams proto = params.toProto();
    assertTrue(proto.hasMinP());
    assertEquals(0.25f, proto.getMinP());
    assertEquals(List.of(7, 3), proto.getStopTokenIdsList());
    assertTrue(proto.hasSkipSpecialTokens());
    assertFalse(proto.getSkipSpecialTokens());
    assertTrue(proto.hasPromptLogprobs());
    assertEquals(2, proto.getPromptLogprobs());
    assertTrue(proto.hasStructuredOutput());
    assertEquals(
        Types.StructuredOutput.ConstraintCase.JSON_SCHEMA,
        proto.getStructuredOutput().getConstraintCase());
    assertEquals("{\"type\": \"object\"}", proto.getStructuredOutput().getJsonSchema());
    assertEquals(
        "SamplingParams{maxNewTokens=8, minP=0.25, stopTokenIds=[7, 3], skipSpecialTokens=false,"
            + " promptLogprobs=2, jsonSchema={\"type\": \"object\"}}",
        params.toString());
  }

  @Test
  void zerosOfTheNewFieldsAreSentAndUnsetOnesAreNot() {
    Types.SamplingParams zeros =
        SamplingParams.builder()
            .minP(0)
            .skipSpecialTokens(true)
            .promptLogprobs(0)
            .build()
            .toProto();
    assertTrue(zeros.hasMinP());
    assertTrue(zeros.hasSkipSpecialTokens());
    assertTrue(zeros.getSkipSpecialTokens());
    assertTrue(zeros.hasPromptLogprobs());
    assertEquals(0, zeros.getPromptLogprobs());

    Types.SamplingParams unset = SamplingParams.defaults().toProto();
    assertFalse(unset.hasMinP());
    assertEquals(0, unset.getStopTokenIdsCount());
    assertFalse(unset.hasSkipSpecialTokens());
    assertFalse(unset.hasPromptLogprobs());
    assertFalse(unset.hasStructuredOutput());
  }

  @Test
  void eachStructuredOutputKindGoesInTheMessage() {
    Types.StructuredOutput object =
        SamplingParams.builder().jsonObject().build().toProto().getStructuredOutput();
    assertEquals(Types.StructuredOutput.ConstraintCase.JSON_OBJECT, object.getConstraintCase());
    assertTrue(object.getJsonObject());
    Types.StructuredOutput regex =
        SamplingParams.builder().regex("[ab]+").build().toProto().getStructuredOutput();
    assertEquals(Types.StructuredOutput.ConstraintCase.REGEX, regex.getConstraintCase());
    assertEquals("[ab]+", regex.getRegex());
    Types.StructuredOutput grammar =
        SamplingParams.builder()
            .grammar("root ::= \"x\"")
            .build()
            .toProto()
            .getStructuredOutput();
    assertEquals(Types.StructuredOutput.ConstraintCase.GRAMMAR, grammar.getConstraintCase());
    assertEquals("root ::= \"x\"", grammar.getGrammar());
    assertEquals(
        "SamplingParams{jsonObject}", SamplingParams.builder().jsonObject().build().toString());
    // A long spec is abbreviated in toString (whole in the message).
    String longRegex = "a".repeat(100);
    SamplingParams longOne = SamplingParams.builder().regex(longRegex).build();
    assertEquals("SamplingParams{regex=" + "a".repeat(61) + "...}", longOne.toString());
    assertEquals(longRegex, longOne.toProto().getStructuredOutput().getRegex());
  }

  @Test
  void atMostOneStructuredOutputConstraint() {
    SamplingParams.Builder builder = SamplingParams.builder().regex("a+");
    String message = refused(() -> builder.jsonSchema("{}"));
    assertTrue(message.startsWith("jsonSchema: regex is already set"), message);
    assertTrue(refused(builder::jsonObject).startsWith("jsonObject: regex"));
    assertTrue(refused(() -> builder.grammar("root ::= \"a\"")).startsWith("grammar: regex"));
    // The refused settings left the first in place; the same kind again replaces it.
    assertEquals("a+", builder.build().toProto().getStructuredOutput().getRegex());
    assertEquals("b+", builder.regex("b+").build().toProto().getStructuredOutput().getRegex());
    SamplingParams.Builder object = SamplingParams.builder().jsonObject().jsonObject();
    assertTrue(refused(() -> object.regex("x")).startsWith("regex: jsonObject is already set"));
  }

  @Test
  void structuredOutputSpecsOutsideTheBoundsAreRefused() {
    int max = SamplingBounds.MAX_STRUCTURED_OUTPUT_CHARS;
    assertEquals(
        "sampling.structured_output.json_schema must not be empty",
        refused(() -> SamplingParams.builder().jsonSchema("")));
    assertEquals(
        "sampling.structured_output.regex must be at most 65536 characters, got 65537",
        refused(() -> SamplingParams.builder().regex("a".repeat(max + 1))));
    refused(() -> SamplingParams.builder().grammar(""));
    // Characters are code points, as the server counts them.
    String emoji = "\uD83D\uDE00".repeat(max);
    assertEquals(
        emoji,
        SamplingParams.builder()
            .grammar(emoji)
            .build()
            .toProto()
            .getStructuredOutput()
            .getGrammar());
    NullPointerException e =
        assertThrows(NullPointerException.class, () -> SamplingParams.builder().jsonSchema(null));
    assertEquals("jsonSchema", e.getMessage());
  }

  @Test
  void minPOutsideTheBoundIsRefused() {
    assertEquals(
        "sampling.min_p must be a finite number in [0, 1] (0 disables it), got 1.5",
        refused(() -> SamplingParams.builder().minP(1.5)));
    assertEquals(
        "sampling.min_p must be a finite number in [0, 1] (0 disables it), got -0.1",
        refused(() -> SamplingParams.builder().minP(-0.1)));
    refused(() -> SamplingParams.builder().minP(Double.NaN));
    refused(() -> SamplingParams.builder().minP(Double.POSITIVE_INFINITY));
    assertEquals(
        (float) SamplingBounds.MAX_MIN_P,
        SamplingParams.builder().minP(SamplingBounds.MAX_MIN_P).build().toProto().getMinP());
  }

  @Test
  void stopTokenIdsOutsideTheBoundsAreRefused() {
    int[] tooMany = new int[SamplingBounds.MAX_STOP_TOKEN_IDS + 1];
    assertEquals(
        "sampling.stop_token_ids: at most 64 token ids, got 65",
        refused(() -> SamplingParams.builder().stopTokenIds(tooMany)));
    assertEquals(
        "sampling.stop_token_ids[1] must be an int >= 0, got -4",
        refused(() -> SamplingParams.builder().stopTokenIds(1, -4)));
    refused(() -> SamplingParams.builder().stopTokenIds(List.of(2, -1)));
    assertEquals(
        SamplingBounds.MAX_STOP_TOKEN_IDS,
        SamplingParams.builder()
            .stopTokenIds(new int[SamplingBounds.MAX_STOP_TOKEN_IDS])
            .build()
            .toProto()
            .getStopTokenIdsCount());
    List<Integer> withNull = new ArrayList<>(List.of(1));
    withNull.add(null);
    NullPointerException e =
        assertThrows(
            NullPointerException.class, () -> SamplingParams.builder().stopTokenIds(withNull));
    assertEquals("stopTokenIds[1]", e.getMessage());
  }

  @Test
  void stopTokenIdsAreCopiedAndTheLastSettingWins() {
    int[] ids = {5, 6};
    SamplingParams.Builder builder = SamplingParams.builder().stopTokenIds(ids);
    ids[0] = 9;
    assertEquals(List.of(5, 6), builder.build().toProto().getStopTokenIdsList());
    assertEquals(
        List.of(8), builder.stopTokenIds(List.of(8)).build().toProto().getStopTokenIdsList());
    assertEquals(List.of(), builder.stopTokenIds().build().toProto().getStopTokenIdsList());
  }

  @Test
  void promptLogprobsOutsideTheBoundIsRefused() {
    int max = SamplingBounds.MAX_PROMPT_LOGPROBS;
    assertEquals(
        "sampling.prompt_logprobs must be an int in [0, 20] (0: the prompt token's only), got 21",
        refused(() -> SamplingParams.builder().promptLogprobs(max + 1)));
    refused(() -> SamplingParams.builder().promptLogprobs(-1));
    assertEquals(
        max, SamplingParams.builder().promptLogprobs(max).build().toProto().getPromptLogprobs());
  }

  @Test
  void priorityGoesInTheRequestAndOutOfBoundsIsRefused() {
    RequestOptions options = RequestOptions.builder().priority(-3).build();
    assertEquals(-3, options.priority());
    assertEquals(0, RequestOptions.defaults().priority());
    Types.GenerationRequest request =
        CbserveClient.request(Prompt.text("x"), SamplingParams.defaults(), options);
    assertEquals(-3, request.getPriority());
    assertEquals(
        0,
        CbserveClient.request(
                Prompt.text("x"), SamplingParams.defaults(), RequestOptions.defaults())
            .getPriority());

    long above = (long) SamplingBounds.MAX_PRIORITY + 1;
    assertEquals(
        "priority must be an int in [-2147483648, 2147483647], got 2147483648",
        refused(() -> RequestOptions.builder().priority(above)));
    refused(() -> RequestOptions.builder().priority((long) SamplingBounds.MIN_PRIORITY - 1));
    assertEquals(
        SamplingBounds.MIN_PRIORITY,
        RequestOptions.builder().priority(SamplingBounds.MIN_PRIORITY).build().priority());
    assertEquals(
        SamplingBounds.MAX_PRIORITY,
        RequestOptions.builder().priority(SamplingBounds.MAX_PRIORITY).build().priority());
  }

  @Test
  void stopReasonsAndPromptLogprobsAreReadFromTheChunk() {
    Types.GenerationChunk.Builder base =
        Types.GenerationChunk.newBuilder()
            .setRequestId("r")
            .setStatus(Types.RequestStatus.REQUEST_STATUS_FINISHED)
            .setFinishReason(Types.FinishReason.FINISH_REASON_STOP);
    Chunk byToken = Convert.chunk(base.clone().addTokenIds(42).setStopTokenId(42).build());
    assertEquals(Optional.of(42), byToken.stopTokenId());
    assertEquals(Optional.empty(), byToken.stopString());
    Chunk byString = Convert.chunk(base.clone().setStopString("User:").build());
    assertEquals(Optional.empty(), byString.stopTokenId());
    assertEquals(Optional.of("User:"), byString.stopString());
    Chunk neither = Convert.chunk(base.clone().build());
    assertTrue(neither.stopTokenId().isEmpty());
    assertTrue(neither.stopString().isEmpty());
    assertTrue(neither.promptLogprobs().isEmpty());

    Types.GenerationChunk withPrompt =
        Types.GenerationChunk.newBuilder()
            .setRequestId("r")
            .setStatus(Types.RequestStatus.REQUEST_STATUS_DECODING)
            .addTokenIds(3)
            .addPromptLogprobs(
                Types.PromptLogprob.newBuilder()
                    .setTokenId(5)
                    .setLogprob(-1.5f)
                    .addTopLogprobs(Types.TopLogprob.newBuilder().setTokenId(6).setLogprob(-0.5f))
                    .addTopLogprobs(Types.TopLogprob.newBuilder().setTokenId(5).setLogprob(-1.5f)))
            .build();
    List<TopLogprob> top = List.of(new TopLogprob(6, -0.5f), new TopLogprob(5, -1.5f));
    assertEquals(
        List.of(new PromptLogprob(5, -1.5f, top)), Convert.chunk(withPrompt).promptLogprobs());

    CompletionBuilder completion = new CompletionBuilder("r");
    completion.add(Convert.chunk(withPrompt));
    completion.add(
        Convert.chunk(
            base.clone().setTokenIndex(1).addTokenIds(42).setStopTokenId(42).build()));
    Completion done = completion.build();
    assertEquals(FinishReason.STOP, done.finishReason());
    assertEquals(Optional.of(42), done.stopTokenId());
    assertTrue(done.stopString().isEmpty());
    assertEquals(Convert.chunk(withPrompt).promptLogprobs(), done.promptLogprobs());
  }

  // -- n (parallel sampling) --

  @Test
  void nGoesInTheMessageAndUnsetIsNotSent() {
    SamplingParams params = SamplingParams.builder().maxNewTokens(4).n(3).seed(7).build();
    Types.SamplingParams proto = params.toProto();
    assertTrue(proto.hasN());
    assertEquals(3, proto.getN());
    assertEquals(7L, proto.getSeed());
    assertEquals("SamplingParams{maxNewTokens=4, seed=7, n=3}", params.toString());
    // 1 is a value the caller gave: sent as set.
    assertTrue(SamplingParams.builder().n(1).build().toProto().hasN());
    assertFalse(SamplingParams.defaults().toProto().hasN());
    assertFalse(SamplingParams.builder().maxNewTokens(4).build().toProto().hasN());
    // The last setting wins.
    assertEquals(5, SamplingParams.builder().n(2).n(5).build().toProto().getN());
  }

  @Test
  void nOutsideTheBoundIsRefused() {
    int max = SamplingBounds.MAX_N;
    assertEquals(128, max);
    assertEquals(
        "sampling.n must be an int in [1, 128], got 0",
        refused(() -> SamplingParams.builder().n(0)));
    assertEquals(
        "sampling.n must be an int in [1, 128], got 129",
        refused(() -> SamplingParams.builder().n(max + 1)));
    refused(() -> SamplingParams.builder().n(-1));
    refused(() -> SamplingParams.builder().n(Integer.MIN_VALUE));
    // A refused setting leaves the earlier one in place.
    SamplingParams.Builder builder = SamplingParams.builder().n(2);
    refused(() -> builder.n(max + 1));
    assertEquals(2, builder.build().toProto().getN());
    assertEquals(max, SamplingParams.builder().n(max).build().toProto().getN());
    assertEquals(1, SamplingParams.builder().n(1).build().toProto().getN());
  }

  @Test
  void theSequenceIndexIsReadFromTheChunk() {
    Types.GenerationChunk.Builder base =
        Types.GenerationChunk.newBuilder()
            .setRequestId("r")
            .setStatus(Types.RequestStatus.REQUEST_STATUS_DECODING)
            .addTokenIds(3);
    assertEquals(0, Convert.chunk(base.build()).index());
    Chunk second = Convert.chunk(base.clone().setIndex(2).build());
    assertEquals(2, second.index());
    CompletionBuilder completion = new CompletionBuilder("r", 2, 0);
    completion.add(second);
    completion.add(
        Convert.chunk(
            base.clone()
                .setIndex(2)
                .setTokenIndex(1)
                .setStatus(Types.RequestStatus.REQUEST_STATUS_FINISHED)
                .setFinishReason(Types.FinishReason.FINISH_REASON_LENGTH)
                .build()));
    Completion done = completion.build();
    assertEquals(2, done.index());
    assertEquals(List.of(3, 3), done.tokenIds());
  }
}
